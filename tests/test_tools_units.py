"""Multi-turn rollouts without Ray: the built-in tools, the environment protocol, tool-call parsing, the loss
mask of a multi-turn sample token for token, and the RL math on responses with the environment's tokens
masked out (stages/ppo/environments.py, stages/ppo/rl.py)."""

from __future__ import annotations

import json

import pytest

from stages.ppo.environments import (Calculator, Renderer, Step, as_step, assemble, calculate,
                                     cap_output, environment_factory, parse_turn)


# --------------------------------------------------------------------------- the calculator


@pytest.mark.parametrize("expression, value", [("347 * 58", "20126"), ("2 ** 10", "1024"), ("(3 + 4) * -2", "-14"),
                                               ("7 / 2", "3.5"), ("8 / 2", "4"), ("17 % 5", "2"), ("2^3", "8")])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, problem", [("1 / 0", "division by zero"), ("__import__('os')", "not arithmetic"),
                                                 ("9 ** 9 ** 9", "too large"), ("2 +", "cannot parse"),
                                                 ("True + 1", "not arithmetic"), ("x * 2", "not arithmetic")])
def test_the_calculator_refuses_what_is_not_arithmetic_without_running_it(expression, problem):
    with pytest.raises(ValueError, match=problem):
        calculate(expression)


def test_a_tool_environment_answers_calls_and_ends_on_a_plain_answer():
    env = Calculator()
    assert env.reset({"prompt": "What is 3 * 4?"}) is None
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3 * 4"}}}
    step = env.step([], {"role": "assistant", "content": "", "tool_calls": [call]})
    assert step == Step([{"role": "tool", "name": "calculator", "content": "12"}], 0.0, False)
    assert env.step([], {"role": "assistant", "content": "The answer is 12."}).done
    with pytest.raises(ValueError, match="unknown tool 'search'; the tools are calculator"):
        env.step([], {"role": "assistant", "tool_calls": [{"function": {"name": "search", "arguments": {}}}]})


def test_step_results_and_outputs_are_normalised():
    assert as_step(([{"role": "user", "content": "again"}], 1, False)) == \
        Step([{"role": "user", "content": "again"}], 1.0)
    with pytest.raises(TypeError, match=r"Step or \(messages, reward, done\)"):
        as_step({"done": True})
    assert cap_output("x" * 5000, 100) == "x" * 100 + "... [4900 characters cut]"
    assert cap_output("short", 100) == "short"


def test_an_environment_that_cannot_be_loaded_is_refused_naming_the_key():
    from pipeline.errors import UserError

    with pytest.raises(UserError, match="stages.ppo.environment.name: cannot load 'nowhere:Env'"):
        environment_factory("nowhere:Env")
    with pytest.raises(UserError, match="has no reset"):
        environment_factory("json:dumps")
    assert isinstance(environment_factory("calculator")(), Calculator)


def test_the_config_refuses_a_budget_smaller_than_one_turn():
    from pydantic import ValidationError

    from stages.ppo.config import PPOConfig

    with pytest.raises(ValidationError, match="environment.max_tokens .8. is the whole multi-turn response"):
        PPOConfig(sampling={"max_new_tokens": 16}, environment={"name": "calculator", "max_tokens": 8})
    with pytest.raises(ValidationError, match="'calculator', 'python' or 'module:Class'"):
        PPOConfig(environment={"name": "abacus"})
    assert PPOConfig(environment={"name": "calculator", "max_tokens": 80}).response_tokens() == 80
    # the environment's reward alone may be the score; with neither it nor a rule or model reward, nothing is
    with pytest.raises(ValidationError, match="nothing would reward the policy"):
        PPOConfig(rewards={"rule_weight": 0}, environment={"name": "calculator", "reward_weight": 0})
    PPOConfig(rewards={"rule_weight": 0}, environment={"name": "calculator"})


def test_editing_a_users_environment_reruns_ppo():
    from stages.ppo import configured_code
    from stages.ppo.config import PPOConfig

    assert configured_code(PPOConfig(environment={"name": "helpers.environments:TwoTurns"})) == ["helpers.environments"]
    assert configured_code(PPOConfig(environment={"name": "calculator"})) == []


# --------------------------------------------------------------------------- parsing with vLLM's parser


def test_a_turn_is_parsed_into_openai_form_and_a_broken_call_is_an_error():
    from vllm.tool_parsers import ToolParserManager

    from stages.common import models, tasks

    tok = models.build_tokenizer(tasks.corpus(tasks.TaskConfig(calculator=0.5), 0, 200), 320)
    parser = ToolParserManager.get_tool_parser("hermes")(tok)
    turn, problem = parse_turn('<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>',
                               parser)
    assert problem is None and turn["content"] == ""
    assert turn["tool_calls"] == [{"type": "function", "id": "call_0",
                                   "function": {"name": "calculator", "arguments": {"expression": "3 * 4"}}}]
    assert parse_turn("The answer is 12.", parser) == ({"role": "assistant", "content": "The answer is 12."}, None)
    turn, problem = parse_turn('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', parser)
    assert "tool_calls" not in turn and problem.startswith("could not read the tool call")


# --------------------------------------------------------------------------- the loss mask, token for token


def test_a_multi_turn_samples_mask_is_1_on_every_model_token_and_0_on_every_environment_token():
    """A hand-built conversation (user, tool call, tool result, answer), assembled as the engine assembles an
    episode: the model's turns as sampled tokens, the tool's message rendered by `Renderer`. The tokens equal
    the chat template's rendering of the whole conversation, and the mask equals the data stage's assistant
    mask of it (render_with_spans / loss_mask: what SFT trains on) token for token."""
    from stages.common import models, tasks
    from stages.data.steps import loss_mask, render_with_spans

    tok = models.build_tokenizer(tasks.corpus(tasks.TaskConfig(calculator=0.5), 0, 200), 400)
    messages = tasks.tool_conversation("What is 347 * 58?", "347 * 58", 20126)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = ids(tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 58"}}</tool_call><|im_end|>'
    env = Renderer(tok).tokens([messages[2]])
    sample = assemble([("model", ids(call), [-0.5] * len(ids(call))), ("env", env, None),
                       ("model", ids("The answer is 20126.<|im_end|>"), None)])

    text, spans = render_with_spans(tok, messages)
    enc = tok(text.rstrip("\n"), add_special_tokens=False, return_offsets_mapping=True)
    assert prompt + sample["ids"] == enc["input_ids"]
    assert sample["mask"] == loss_mask(enc["offset_mapping"], spans)[len(prompt):]
    # and by hand: the call and the answer are the model's, "\n<|im_start|>tool\n20126<|im_end|>\n<|im_start|>
    # assistant\n" the environment's
    assert tok.decode([t for t, m in zip(sample["ids"], sample["mask"]) if not m]) == \
        "\n<|im_start|>tool\n20126<|im_end|>\n<|im_start|>assistant\n"
    assert sample["mask"].count(1) == len(ids(call)) + len(ids("The answer is 20126.<|im_end|>"))
    assert sample["logprobs"][: len(ids(call))] == [-0.5] * len(ids(call)) and \
        not any(sample["logprobs"][len(ids(call)):])
    assert tok.decode(sample["ids"][slice(*sample["final"])]) == "The answer is 20126.<|im_end|>"
    # a turn cut before its end-of-turn token: the environment's tokens close it first
    assert tok.decode(Renderer(tok).tokens([messages[2]], close=True)) == \
        "<|im_end|>\n<|im_start|>tool\n20126<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------- the RL math with holes in the mask


def test_the_score_lands_on_the_last_model_token_and_gae_skips_the_environments_tokens():
    import torch

    from stages.ppo import rl

    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float)
    rewards = rl.token_rewards(torch.tensor([2.0, 3.0]), torch.zeros(2, 6), mask, kl_coef=0.1)
    assert rewards.tolist() == [[0, 0, 0, 0, 2.0, 0], [0, 0, 3.0, 0, 0, 0]]
    # GAE over a response with a hole equals GAE over the same response with the hole removed
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.7, 9.0]])
    r = torch.tensor([[0.1, -0.2, 5.0, 5.0, 1.0, 5.0]])
    adv, ret = rl.gae(r, values, mask[:1], gamma=0.9, lam=0.8)
    dense_adv, dense_ret = rl.gae(r[:, [0, 1, 4]], values[:, [0, 1, 4]], torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert torch.allclose(adv[:, [0, 1, 4]], dense_adv) and torch.allclose(ret[:, [0, 1, 4]], dense_ret)
    assert not adv[:, [2, 3, 5]].any()


def test_a_rollout_batch_masks_the_environments_tokens_out():
    from stages.ppo.scoring import episode_stats, rollout_batch

    rows = [{"prompt_ids": [1, 2]}, {"prompt_ids": [3]}]
    flat = [{"ids": [5, 6, 7, 8], "mask": [1, 0, 0, 1], "turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_s": 0.5,
             "env_reward": 0.0},
            {"ids": [9], "mask": [1], "turns": 1, "tool_calls": 0, "tool_errors": 1, "tool_s": 0.0, "env_reward": 1.0,
             "env_error": "ValueError: Step.reward must be a finite number, got nan"}]
    batch = rollout_batch(rows, flat, pad_id=0)
    assert batch["response_mask"].tolist() == [[1, 0, 0, 1], [1, 0, 0, 0]]
    assert episode_stats(flat) == {"turns_per_sample": 1.5, "tool_calls_per_sample": 0.5, "tool_errors": 1.0,
                                   "tool_s": 0.5, "env_reward_mean": 0.5, "env_errors": 1.0}
    assert json.dumps(episode_stats([{"ids": [1]}])) == "{}"  # single-turn samples: no tool metrics


def test_the_calculator_task_shows_the_tool_on_its_share_of_the_same_problems():
    from stages.common import tasks

    plain = tasks.sft_rows(400, 0, tasks.TaskConfig(min_digits=2, max_digits=2, ops=["*"]))
    tools = tasks.sft_rows(400, 0, tasks.TaskConfig(min_digits=2, max_digits=2, ops=["*"], calculator=0.5))
    assert [r["group"] for r in plain] == [r["group"] for r in tools]  # the same problems, with or without tools
    called = [r for r in tools if len(r["messages"]) == 4]
    assert 160 < len(called) < 240
    user, call, result, answer = called[0]["messages"]
    a, b = called[0]["group"].split(" * ")
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"expression": f"{a} * {b}"}
    assert result == {"role": "tool", "content": str(int(a) * int(b)), "tool_calls": None}
    assert answer["content"] == f"The answer is {int(a) * int(b)}."
    assert all(set(m) == {"role", "content", "tool_calls"} for r in tools for m in r["messages"])  # one Arrow schema


# --------------------------------------------------------------------------- an engine stalled by its environment


def test_an_episodes_call_promises_a_tight_next_beat_whenever_the_users_code_may_run(monkeypatch):
    """The follower kills an engine silent past its last promise (issue 48, item 6). While the user's code may
    run the promise is the oldest call's remaining timeout + grace, so a step holding the interpreter is caught
    soon after its timeout; while only vLLM runs it is loose, so a long prefill is never taken for a stall."""
    from stages.ppo import episodes
    from stages.ppo.episodes import STALL_GRACE_S, VLLM_SILENCE_S, _Heartbeat

    now = [1000.0]
    monkeypatch.setattr(episodes.time, "time", lambda: now[0])
    clock = _Heartbeat(timeout_s=5)
    assert clock.beat(user_code=True) == {"within": 5 + STALL_GRACE_S}  # constructors and resets next
    now[0] += 0.1
    assert clock.beat(user_code=True) is None  # the same promise, said 0.1 s ago
    assert clock.beat() == {"within": VLLM_SILENCE_S}  # only vLLM next (the first prefill): loosened at once
    clock.stepped(4.0)
    now[0] += 0.1
    assert clock.beat(user_code=True, force=True) == {"within": 5 + STALL_GRACE_S + 12}  # calls start next
    now[0] += 3
    assert clock.beat(oldest=now[0] - 2) == {"within": 3 + STALL_GRACE_S + 12}  # the oldest call started 2 s ago
    now[0] += 10
    assert clock.beat(oldest=now[0] - 12) == {"within": STALL_GRACE_S + 12}  # past its timeout: abandoned next step


def test_an_engine_stalled_on_every_attempt_stops_the_stage_naming_the_environment_and_the_fix():
    from pipeline.errors import StageError
    from stages.common.engines import EnginePool
    from stages.common.followed import EngineStalled
    from stages.ppo.episodes import EpisodeSpec, retrying

    class Pool:  # EnginePool's retry, with engines that are always found dead (killed by the follower)
        retrying, restarts = EnginePool.retrying, 0

        def revive(self):
            self.restarts += 1
            return [0]

    def stalls(times):
        calls = []

        def call():
            calls.append(1)
            if len(calls) <= times:
                raise EngineStalled("a rollout engine stopped answering while the environment my_env:Env ran")
            return "samples"
        return call

    said, spec = [], EpisodeSpec("my_env:Env", tool_timeout_s=7)
    assert retrying(Pool(), stalls(2), spec, said.append) == "samples"  # twice stalled, then answered
    assert len(said) == 2 and "rollout engine(s) [0] restarted and re-synced after a rollout engine stopped" in said[0]
    pool = Pool()
    with pytest.raises(StageError) as exc:
        retrying(pool, stalls(3), spec, said.append)
    assert pool.restarts == 3
    for part in ("the environment my_env:Env stalled its rollout engine on 3 attempt(s)", "tool_timeout_s (7 s)",
                 "stages.ppo.environment.tool_timeout_s", "subprocess"):
        assert part in str(exc.value)
    with pytest.raises(EngineStalled):  # single-turn rollouts have no environment to blame: the error as raised
        retrying(Pool(), stalls(3), None, said.append)

    class Synced(Pool):  # rollout.async: the weight sync restarted the engine after the request went out
        restarts = 1

        def revive(self):
            return []

    assert retrying(Synced(), stalls(1), spec, said.append, since=0) == "samples"
    assert "restarted since the request went out" in said[-1]
    with pytest.raises(StageError, match="on 1 attempt"):  # nothing restarted since: not sent again
        retrying(Synced(), stalls(1), spec, said.append, since=1)
