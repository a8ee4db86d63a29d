"""How a problem's text becomes the token ids the engine and an SFT stage see: a raw format string, or
the tokenizer's own chat template.

``PromptSettings`` is the config part (``data.template``, ``data.chat_template``, ``data.system_prompt``,
``data.enable_thinking``, ``data.instruction``), shared by the train job's ``data`` and the SFT job's.
``PromptFormat`` is those settings resolved against one tokenizer. A raw prompt is
``data.template`` with ``{prompt}`` filled in, tokenized as the engine tokenizes text. A chat prompt is
the conversation ``[system?, user: problem + instruction]`` rendered by
``tokenizer.apply_chat_template(..., add_generation_prompt=True)``, whose ids are used as they are, so
a template that writes its own BOS text does not get a second one from the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import field_validator, model_validator

from sliderl.cluster.config.base import HFModel, Section
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.records import Problem

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
RAW_TEMPLATE = "{prompt}"


class PromptSettings(Section):
    """How prompts are written: a raw template, or the model's chat template (system prompt, thinking, instruction)."""

    template: str | None = None
    """Raw prompt: ``{prompt}`` is replaced by the problem text and the result is tokenized as it is. None: the
    chat template when it applies (see chat_template), else ``{prompt}``. Setting it means raw prompts."""
    chat_template: bool | None = None
    """true: prompts through the tokenizer's chat template (an error when it has none); false: raw prompts
    (data.template). null (auto): the chat template when the model is a model.type=hf directory whose tokenizer
    has one, the prompts come from a dataset (data.source is not task) and data.template is not set; SFT on
    chat-messages files uses the chat template whenever the tokenizer has one."""
    system_prompt: str | None = None
    """Chat prompts: the system message put first (None: no system message; a messages file keeps its own)."""
    enable_thinking: bool | None = None
    """Chat prompts: passed to apply_chat_template as enable_thinking (Qwen3: false writes an empty
    <think></think> block into the prompt); None passes nothing, so the template's default holds. Templates
    that do not read it ignore it."""
    instruction: str = BOXED_INSTRUCTION
    """Chat prompts: appended to the problem in the user message after a blank line ("" for none); not used
    for raw prompts (write it into data.template) or for messages files (their user turns are used as written)."""

    @field_validator("template")
    @classmethod
    def _has_placeholder(cls, template: str | None) -> str | None:
        if template is not None and "{prompt}" not in template:
            raise ValueError(f"template must contain {{prompt}}, got {template!r}")
        return template

    @model_validator(mode="after")
    def _one_format(self) -> PromptSettings:
        if self.template is not None and self.chat_template:
            raise ValueError(f"template={self.template!r} asks for raw prompts and chat_template=true for the "
                             "tokenizer's chat template; set one of them (template: null for chat prompts)")
        if self.template is not None or self.chat_template is False:
            self._check_no_chat_options("raw prompts are used (template set or chat_template=false)")
        return self

    def _check_no_chat_options(self, why: str) -> None:
        """Chat-only settings given while prompts are raw would be silently unused: an error instead."""
        for name in ("system_prompt", "enable_thinking"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}={getattr(self, name)!r} only applies to chat-templated prompts, but {why}")


@dataclass(frozen=True)
class PromptFormat:
    """``PromptSettings`` resolved against one tokenizer: ``problem(text)`` and ``conversation(messages)``
    give ``(prompt text, prompt token ids)``."""

    tokenizer: Any = field(repr=False, compare=False)
    chat: bool
    template: str = RAW_TEMPLATE
    system_prompt: str | None = None
    instruction: str = ""
    enable_thinking: bool | None = None

    def problem(self, text: str) -> tuple[str, list[int]]:
        """The prompt for one problem's text."""
        if not self.chat:
            prompt = self.template.format(prompt=text)
            return prompt, list(self.tokenizer(prompt).input_ids)
        user = f"{text}\n\n{self.instruction}" if self.instruction else text
        return self.conversation([{"role": "user", "content": user}])

    def conversation(self, messages: list[dict]) -> tuple[str, list[int]]:
        """The chat prompt of ``messages`` (the system prompt put first when they have none), ending in the
        assistant's generation prompt."""
        if not self.chat:
            raise ValueError("conversation() needs the chat template; this format writes raw prompts")
        if self.system_prompt is not None and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        options = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, **options)["input_ids"]
        return text, list(ids)

    def apply(self, problems: list[Problem]) -> list[Problem]:
        """``problems`` (their prompt being the problem text) with the formatted prompt and its token ids."""
        formatted = []
        for p in problems:
            text, ids = self.problem(p.prompt)
            formatted.append(replace(p, prompt=text, prompt_token_ids=tuple(ids)))
        return formatted


def prompt_format(data: PromptSettings, model, tokenizer, conversations: bool = False) -> PromptFormat:
    """The format a job's ``data`` settings give with ``tokenizer``, for prompts from ``data.source`` on ``model``
    (a ModelSource).

    ``conversations``: the data is chat messages, so auto means the chat template whenever the tokenizer has one.
    Raises ConfigError when the chat template is asked for and the tokenizer has none, or chat-only settings
    are given while prompts resolve to raw.
    """
    has_template = getattr(tokenizer, "chat_template", None) is not None
    chat = data.chat_template
    if chat is None:
        wanted = conversations or (isinstance(model, HFModel) and data.source != "task")
        chat = data.template is None and has_template and wanted
    if chat and not has_template:
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        raise ConfigError(f"{'data.chat_template=true' if data.chat_template else 'chat-messages data'} needs "
                          f"the tokenizer's chat template, but the tokenizer of {name!r} has none; use raw prompts "
                          "(data.template) or a model whose tokenizer has a chat_template")
    if not chat:
        try:
            data._check_no_chat_options("prompts resolve to raw here (data.chat_template: null uses the chat "
                                            "template only for a dataset on a model.type=hf model whose tokenizer "
                                            "has one; set data.chat_template=true)")
        except ValueError as err:
            raise ConfigError(f"data: {err}") from None
        return PromptFormat(tokenizer, False, data.template or RAW_TEMPLATE)
    return PromptFormat(tokenizer, True, RAW_TEMPLATE, data.system_prompt, data.instruction, data.enable_thinking)
