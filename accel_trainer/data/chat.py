"""Conversations as a model's tokens, through a chat template, with the assistant's tokens marked for the loss.

A row is either `messages` (a list of {"role", "content"}: system, user and assistant, any number of turns) or
`prompt`/`completion`: each a list of messages (TRL's conversational prompt-completion form) or plain text (a
user's message and the assistant's answer). Which tokens are the assistant's is found as TRL finds a completion:
the conversation up to a reply, rendered with the generation prompt, is a prefix of the conversation with the
reply; the tokens after that prefix are the reply's (for ChatML: its text, `<|im_end|>` and the newline). It
needs no `{% generation %}` marks in the template, so the base's own template serves as it is. A template that
rewrites earlier turns (so that a shorter conversation is no prefix of a longer one) is refused in one line.

The template is the base's own by default (`chat_template=""`), or `chatml`, or a `.jinja` file
(`resolve_template`); the tokenizer keeps it, so final/ and `accel-trainer sample --chat` use it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accel_trainer.errors import ConfigError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as Qwen and SmolLM write it, without a default system message."""
FORMS = [{"messages": "messages"}, {"prompt": "prompt", "completion": "completion"}]
"""The columns a chat source may have (data.sources.read_data's forms)."""


def check_template_choice(choice: str) -> str:
    """A `chat_template=` value checked when the config is made: "", "chatml" or an existing .jinja file (made
    absolute).

    Raises:
        ConfigError: neither a known name nor a file.
    """
    if choice in ("", "chatml"):
        return choice
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"chat_template={choice}: no such file (give chatml, a .jinja file, or nothing for the base's own template)"
        )
    return str(path.resolve())


def resolve_template(tokenizer: Any, choice: str) -> None:
    """Give `tokenizer` the chosen chat template: its own (""), ChatML, or a file's.

    Raises:
        ConfigError: the base has no template of its own and none was chosen.
    """
    if choice == "chatml":
        tokenizer.chat_template = CHATML
    elif choice:
        tokenizer.chat_template = Path(choice).read_text()
    elif not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "the base's tokenizer has no chat template: choose one, chat_template=chatml or a .jinja file"
        )


def as_turns(row: dict[str, Any]) -> dict[str, Any]:
    """A row's conversation as one list of messages, `messages`, and the index of the first message whose replies
    train, `trained_from`: 0 for a row of messages (every reply trains); for a prompt-completion row, prompt and
    completion joined, only the completion's replies training, as TRL's SFTTrainer trains a completion (plain text
    is a user's message and the assistant's answer, put through the chat template; TRL would join plain text
    without one)."""
    if "messages" in row:
        return {"messages": list(row["messages"]), "trained_from": 0}
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    return {"messages": list(prompt) + list(completion), "trained_from": len(prompt)}


def tokenize_conversation(tokenizer: Any, turns: list[dict[str, str]], trained_from: int = 0) -> dict[str, list[int]]:
    """The conversation's token ids and a mask of the assistant's tokens (1) among them, those of the replies from
    message `trained_from` on (earlier replies are context, 0).

    Raises:
        ConfigError: no assistant message, or a template whose shorter conversations are no prefix of longer ones.
    """
    ids: list[int] = []
    mask: list[int] = []
    for end, message in enumerate(turns):
        if message["role"] != "assistant" or end < trained_from:
            continue
        prompt = render_ids(tokenizer, turns[:end], generation_prompt=True) if end else []
        upto = render_ids(tokenizer, turns[: end + 1], generation_prompt=False)
        if upto[: len(ids)] != ids or upto[: len(prompt)] != prompt or len(prompt) < len(ids):
            raise ConfigError(
                "the chat template renders a conversation's earlier turns differently once it goes on (it is no"
                " prefix of the longer one), so the assistant's tokens cannot be told apart: choose"
                " chat_template=chatml or a .jinja file that keeps earlier turns as they are"
            )
        if len(upto) == len(prompt):
            raise ConfigError(
                "the chat template writes nothing of an assistant's reply (the conversation with it renders as"
                " without it), so there would be nothing to learn: choose a template that renders each message,"
                " chat_template=chatml or the base's own"
            )
        mask += [0] * (len(prompt) - len(ids)) + [1] * (len(upto) - len(prompt))
        ids = upto
    if not ids:
        raise ConfigError(
            "a conversation has no assistant message to learn (role 'assistant'"
            f"{' in its completion' if trained_from else ''}): roles seen {sorted({m['role'] for m in turns})}"
        )
    whole = render_ids(tokenizer, turns, generation_prompt=False)  # turns after the last reply are context only
    return {"input_ids": whole, "assistant_masks": mask + [0] * (len(whole) - len(mask))}


def tokenize_row(row: dict[str, Any], index: int, tokenizer: Any, split: str) -> dict[str, list[int]]:
    """`tokenize_conversation` of a row of `messages` and `trained_from` (as_turns), for `Dataset.map` (a plain
    function, which datasets can hash for its cache); an error names the row.

    Raises:
        ConfigError: as tokenize_conversation, naming the split and the row.
    """
    try:
        return tokenize_conversation(tokenizer, row["messages"], row["trained_from"])
    except ConfigError as error:
        raise ConfigError(f"{split} conversation {index}: {error}") from None


def render_ids(tokenizer: Any, turns: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    """The conversation's tokens in the tokenizer's chat template (its special tokens are the template's)."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
