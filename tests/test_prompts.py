"""Prompts through the tokenizer's chat template (issue 15, scope 2): the ids the engine receives are the
tokenizer's own ``apply_chat_template(..., add_generation_prompt=True)`` ids, the up-front length filter
measures them, and the raw ``data.template`` path is what it was."""

from __future__ import annotations

import json
import queue

import pytest
from transformers import AutoTokenizer

from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.run.plan import prepare

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."  # written out, not imported
# A Qwen3-like template: it writes the tokenizer's BOS text first and reads enable_thinking after the
# generation prompt, as Qwen3's does.
BOS_THINKING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def math_job(tmp_path, model, source, *overrides) -> TrainConfig:
    """A math job on ``source`` (columns id, problem, answer) with a local HF model; no warm start, no eval."""
    return load_config(TrainConfig, None, [
        "task.type=math", f"data.source={source}", "data.prompt_field=problem", "data.id_field=id",
        "warmstart.enabled=false", "model.type=hf", f"model.path={model}", "eval.before=false", "eval.after=false",
        f"run_dir={tmp_path / 'run'}", *overrides])


def reference_ids(model, messages, **options) -> list[int]:
    """The tokenizer's own chat-template ids, from transformers directly."""
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                              **options)["input_ids"])


ROWS = [{"id": "q1", "problem": "What is 2 + 3?", "answer": "5"}, {"id": "q2", "problem": "Halve 18.", "answer": "9"}]


@pytest.mark.parametrize("system", [None, "You are a careful mathematician."])
def test_chat_prompts_are_the_tokenizers_own_template_ids(tmp_path, tiny_model_factory, system):
    # Catches: prompts sent raw although the model is an HF directory with a chat template (auto), the
    # system prompt dropped, the instruction not appended, or the generation prompt left out (the model
    # would then have to write "<|im_start|>assistant" itself). Reference: transformers' own
    # apply_chat_template on the conversation the docs describe.
    model = tiny_model_factory("qwen3")
    source = write_rows(tmp_path / "problems.jsonl", ROWS)
    extra = [] if system is None else [f"data.system_prompt={system}"]
    plan = prepare(math_job(tmp_path, model, source, *extra))
    for problem, row in zip(plan.train_problems, ROWS):
        messages = ([] if system is None else [{"role": "system", "content": system}]) + [
            {"role": "user", "content": f"{row['problem']}\n\n{INSTRUCTION}"}]
        assert list(problem.prompt_token_ids) == reference_ids(model, messages)
        assert problem.engine_prompt == reference_ids(model, messages)
        assert (problem.prompt_id, problem.answer) == (row["id"], row["answer"])
        assert problem.prompt.endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """A tiny model whose tokenizer adds a BOS (``<s>``) when it encodes text and whose chat template writes
    the BOS text itself (as Llama 3's does), and reads enable_thinking (as Qwen3's does)."""
    from tokenizers import processors

    from sliderl.core.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("bos") / "m", "qwen3", hidden_size=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, intermediate_size=64, extra_special_tokens=("<s>",))
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer.bos_token = "<s>"
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.chat_template = BOS_THINKING_TEMPLATE
    tokenizer.save_pretrained(str(path))
    reloaded = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert reloaded("x").input_ids == [bos, ord("x")]  # the setup holds: encoding text adds the BOS
    return path


def test_a_template_that_writes_its_bos_reaches_engine_and_trainer_with_one_bos(tmp_path, bos_model):
    # Catches: the templated text encoded again with special tokens (two BOS: the template's and the
    # tokenizer's), enable_thinking not passed to the template, the rollout worker sending the prompt's
    # text instead of its ids (the engine would encode it and add the second BOS), or the SFT trainer
    # re-encoding a chat prompt's text instead of using its ids (a warm start would train two BOS) or putting
    # a BOS before the completion. The reference ids are transformers' apply_chat_template; the engine's are
    # read back from the worker's trace.
    from sliderl.cluster.actors.rollout_worker import RolloutWorker
    from sliderl.cluster.config.prompts import prompt_format
    from sliderl.cluster.records import PromptGroup
    from sliderl.cluster.run.sft_job import written
    from sliderl.rewards import RewardSpec
    from sliderl.rollout import EngineArgs, SamplingParams
    from sliderl.trainer.sft import sft_trace

    source = write_rows(tmp_path / "problems.jsonl", ROWS[:1])
    plan = prepare(math_job(tmp_path, bos_model, source, "data.enable_thinking=false", "data.instruction=''"))
    expected = reference_ids(bos_model, [{"role": "user", "content": ROWS[0]["problem"]}], enable_thinking=False)
    bos = AutoTokenizer.from_pretrained(str(bos_model), local_files_only=True).bos_token_id
    assert expected.count(bos) == 1 and expected[-1] == ord("\n")  # ... "<think>\n\n</think>\n\n" ends it
    problem = plan.train_problems[0]
    assert list(problem.prompt_token_ids) == expected
    out: queue.Queue = queue.Queue()
    worker = RolloutWorker(0, str(bos_model), 0, EngineArgs(num_blocks=64), SamplingParams(max_tokens=2),
                           RewardSpec(), "math", out)
    try:
        worker.submit([PromptGroup("g00000000", problem, 1, 7)])
        trace = out.get(timeout=120).traces[0]
    finally:
        worker.stop()
    assert trace.prompt_token_ids == expected
    cfg = math_job(tmp_path, bos_model, source, "data.enable_thinking=false", "data.instruction=''")
    tokenizer = AutoTokenizer.from_pretrained(str(bos_model), local_files_only=True)
    example = written(prompt_format(cfg.data, cfg.model, tokenizer), [(ROWS[0]["problem"], "5")], source)[0]
    trace = sft_trace(tokenizer, example, "full", 0)
    assert trace.prompt_token_ids == expected
    assert trace.completion_token_ids == [ord("5"), tokenizer.eos_token_id]  # no BOS inside the sequence


def test_the_length_filter_measures_the_templated_prompt(tmp_path, tiny_model_factory, capsys):
    # Catches: the up-front filter measuring the problem text (or the raw template) while the engine gets the
    # templated prompt: a problem that fits raw but not templated would reach a worker and kill the run
    # ("prompt of N tokens does not fit"). Byte-level tokenizer: n ASCII chars are n tokens raw.
    model = tiny_model_factory("qwen3")
    rows = [{"id": f"q{n}", "problem": "x" * n, "answer": "1"} for n in (4, 20, 8)]
    source = write_rows(tmp_path / "problems.jsonl", rows)
    templated = {r["id"]: len(reference_ids(model, [{"role": "user", "content": r["problem"]}])) for r in rows}
    limit = 32
    assert all(len(r["problem"]) < limit for r in rows)  # every problem fits raw ...
    assert [i for i, n in templated.items() if n >= limit] == ["q20"]  # ... one does not fit templated
    plan = prepare(math_job(tmp_path, model, source, "data.instruction=''", f"engine.max_model_len={limit}"))
    assert [p.prompt_id for p in plan.train_problems] == ["q4", "q8"]
    assert "left out 1 of 3 train problems" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=f"no train prompt fits max_model_len={min(templated.values())}"):
        prepare(math_job(tmp_path, model, source, "data.instruction=''", f"engine.max_model_len={min(templated.values())}",
                         f"run_dir={tmp_path / 'run2'}"))


def test_raw_prompts_are_unchanged_for_generated_tasks_and_data_template(tmp_path, tiny_model_factory):
    # Catches: the chat template taken (auto) for a generated task on an HF directory, as the cluster tests
    # and a warm-started arith run use, or data.template no longer applied. Raw prompt ids are the
    # tokenizer's encoding of the text, exactly what the engine did with text before.
    model = tiny_model_factory("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    arith = load_config(TrainConfig, None, ["warmstart.enabled=false", "model.type=hf", f"model.path={model}",
                                            "task.train_size=8", "eval.num_problems=4", "task.eval_size=4",
                                            f"run_dir={tmp_path / 'arith'}"])
    plan = prepare(arith)
    for problem in plan.train_problems + plan.eval_problems:
        assert problem.prompt.startswith("Start at ") and "<|im_start|>" not in problem.prompt
        assert list(problem.prompt_token_ids) == tokenizer(problem.prompt).input_ids
    source = write_rows(tmp_path / "problems.jsonl", ROWS)
    raw = prepare(math_job(tmp_path, model, source, 'data.template="Q: {prompt}\\nA:"'))
    assert [p.prompt for p in raw.train_problems] == [f"Q: {r['problem']}\nA:" for r in ROWS]
    assert [list(p.prompt_token_ids) for p in raw.train_problems] == [tokenizer(f"Q: {r['problem']}\nA:").input_ids
                                                                     for r in ROWS]


def test_chat_settings_the_job_cannot_use_are_errors(tmp_path, tiny_model_factory):
    # Catches: data.chat_template=true silently falling back to raw prompts with a tokenizer that has no chat
    # template, and a system prompt silently dropped because prompts resolved to raw (a tiny model is raw
    # under auto).
    from sliderl.core.tiny import make_tiny_model

    plain = make_tiny_model(tmp_path / "plain", "qwen3", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64)
    tokenizer = AutoTokenizer.from_pretrained(str(plain), local_files_only=True)
    tokenizer.chat_template = None
    for leftover in plain.glob("chat_template*"):
        leftover.unlink()
    tokenizer.save_pretrained(str(plain))
    source = write_rows(tmp_path / "problems.jsonl", ROWS)
    with pytest.raises(ConfigError, match="data.chat_template=true needs the tokenizer's chat template, but the "
                                          "tokenizer of .* has none"):
        prepare(math_job(tmp_path, plain, source, "data.chat_template=true"))
    tiny = load_config(TrainConfig, None, ["task.type=math", f"data.source={source}", "data.prompt_field=problem",
                                           "warmstart.enabled=false", "data.system_prompt=Be brief.",
                                           f"model.cache_dir={tmp_path / 'models'}", "eval.before=false",
                                           "eval.after=false", f"run_dir={tmp_path / 'tiny'}"])
    with pytest.raises(ConfigError, match="system_prompt='Be brief.' only applies to chat-templated prompts"):
        prepare(tiny)
