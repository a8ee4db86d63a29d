import sys, yaml
from pathlib import Path
src, root, variant, seed = Path(sys.argv[1]), Path(sys.argv[2]).resolve(), sys.argv[3], sys.argv[4]
cfg = yaml.safe_load(src.read_text())
cfg["task"]["answer"] = variant
out = root / variant / f"eval-s{seed}"
cfg["eval"]["compare"]["output_dir"] = str(out)
cfg["eval"]["compare"]["entries"] = [
    {"label": "SW-trained", "checkpoint": str(root / variant / "sliding_window" / f"s{seed}" / "sft" / "model"),
     "kv": "sliding_window:124"},
    {"label": "PS-trained", "checkpoint": str(root / variant / "prefix_sliding" / f"s{seed}" / "sft" / "model"),
     "kv": "prefix_sliding:90"},
]
out.mkdir(parents=True, exist_ok=True)
(out / "eval.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
print(out / "eval.yaml")
