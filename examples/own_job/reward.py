"""The example's reward: the task's `exact` verifier against the reference answer or any of the row's
`aliases` (a column of the user's prompts file, which the reward function names to receive it)."""

from stages.common.verifiers import exact


def accepts(response: str, answer: str, aliases: list[str] | None = None) -> float:
    """1.0 if the response's final answer is the answer or one of its accepted spellings, else 0.0."""
    return float(any(exact(response, a) for a in [answer, *(aliases or [])]))
