"""Prompt templates: the paper's "Answer: $Answer" prompt, a \\boxed{} prompt, optionally chat-formatted."""

from typing import Any

# The DAPO/EBPO prompt: the reward reads the last "Answer:" line.
ANSWER_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
BOXED_TEMPLATE = (
    "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)

TEMPLATES = {"answer": ANSWER_TEMPLATE, "boxed": BOXED_TEMPLATE, "plain": "{problem}"}


def format_prompt(problem: str, template: str = "answer") -> str:
    """The problem in a named template (TEMPLATES) or a custom string with one "{problem}"."""
    text = TEMPLATES.get(template, template)
    if "{problem}" not in text:
        raise ValueError(
            f"unknown prompt template {template!r}; known: {sorted(TEMPLATES)}, "
            "or a format string containing {problem}"
        )
    return text.format(problem=problem)


def render_prompt(
    tokenizer: Any,
    problem: str,
    *,
    template: str = "answer",
    chat: bool = True,
    system: str | None = None,
    chat_kwargs: dict | None = None,
) -> str:
    """The text the policy sees: the templated problem, in the tokenizer's chat template if `chat`.

    `chat_kwargs` go to `apply_chat_template` (e.g. {"enable_thinking": False} for Qwen3).
    """
    content = format_prompt(problem, template)
    if not chat:
        if system:
            raise ValueError("a system prompt needs chat=True")
        return content
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat=True but tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no "
            "chat template; use chat=False for a base model"
        )
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(chat_kwargs or {})
    )
