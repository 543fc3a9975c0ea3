"""Rule rewards for tests: `stages.ppo.rewards.rule: helpers.toy_rewards:NAME` (tests/ is on sys.path)."""


def digits(prompt: str, response: str, answer: str) -> float:
    """Share of the response's characters that are digits: a reward a barely trained policy can
    raise in a few PPO iterations (digits are a few of its tokens, each already likely now and then)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
