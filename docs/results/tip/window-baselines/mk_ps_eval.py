import sys, yaml
from pathlib import Path
src, out_dir, answer = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
cfg = yaml.safe_load(src.read_text())
cfg["task"]["answer"] = answer
dense = next(e["checkpoint"] for e in cfg["eval"]["compare"]["entries"] if e["label"] == "Dense")
cfg["eval"]["compare"]["output_dir"] = str(out_dir)
cfg["eval"]["compare"]["entries"] = [
    {"label": "Dense", "checkpoint": dense, "kv": "full"},
    {"label": "Dense under PS:48", "checkpoint": dense, "kv": "prefix_sliding:48"},
    {"label": "Dense under PS:90", "checkpoint": dense, "kv": "prefix_sliding:90"},
    {"label": "StreamingLLM@TIP-peak", "checkpoint": dense, "kv": "streaming:4:120"},
]
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / "eval.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
print(out_dir / "eval.yaml")
