"""The ppo stage's layouts behind one protocol (stages/ppo/layouts/; issue 69, item 1): both implement every member
of `Layout` with its signature, nothing outside the layout modules asks which layout it holds, a lost process
restarts the stage from its checkpoint in either layout, and each layout launches and retries generation its way
(stand-in actors: no Ray cluster)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _layouts():
    from stages.ppo.layouts.colocated import Colocated
    from stages.ppo.layouts.separate import Separate

    return Separate, Colocated


def _members():
    from stages.ppo.layouts import Layout

    return {name: value for name, value in vars(Layout).items() if not name.startswith("_")} \
        | {name: None for name in Layout.__annotations__}


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]


@pytest.mark.parametrize("index", [0, 1], ids=["separate", "colocated"])
def test_each_layout_implements_every_member_of_the_protocol_with_its_signature(index):
    from stages.ppo.config import PPOConfig

    layout = _layouts()[index]
    made = layout(PPOConfig())
    for name, proto in _members().items():
        assert hasattr(made, name), f"{layout.__name__} lacks {name}"
        if proto is not None:
            assert _params(getattr(layout, name)) == _params(getattr(proto, "__func__", proto)), (layout, name)


def test_a_layout_is_looked_up_by_its_config_value():
    from stages.ppo.config import PPOConfig
    from stages.ppo.layouts import layout_of

    separate, colocated = _layouts()
    assert layout_of(PPOConfig()) is separate and layout_of(PPOConfig(layout="colocated")) is colocated
    assert {cls.name for cls in _layouts()} == {"separate", "colocated"}


LAYOUT_TEST = re.compile(r"""layout\s*[!=]=|[!=]=\s*["'](colocated|separate)["']|\bif colocated\b|"""
                         r"""isinstance\([^)]*(RankEngines|Colocated|Separate|EnginePool|RoleView)|hasattr\([^)]*(pool|layout)""")


def test_nothing_outside_the_layout_modules_asks_which_layout_it_holds():
    found = []
    for path in sorted((ROOT / "stages").rglob("*.py")):
        if "layouts" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if LAYOUT_TEST.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_pattern_finds_the_tests_it_is_meant_to_find():
    for line in ('if cfg.layout == "colocated":', 'if hasattr(self.pool, "sync_in_place"):',
                 "if isinstance(s.pool, RankEngines):", "if colocated:", 'x = a if layout != "separate" else b'):
        assert LAYOUT_TEST.search(line), line


def test_a_lost_process_restarts_the_stage_from_its_checkpoint_in_either_layout(monkeypatch):
    import ray

    import stages.ppo as ppo
    from stages.ppo.config import PPOConfig
    from stages.ppo.layouts import MAX_RESTARTS, lost

    assert lost(ray.exceptions.RayActorError()) and not lost(ValueError("a bug in live code"))
    for layout in ("separate", "colocated"):
        calls, logged = [], []

        def fake_run(cfg, ctx, drills):
            calls.append(drills)
            if len(calls) == 1:
                raise ray.exceptions.RayActorError()
            return {"policy_model": Path("out")}

        monkeypatch.setattr(ppo, "_run", fake_run)
        ctx = SimpleNamespace(log_metrics=logged.append, progress=lambda line: None)
        assert ppo.run(PPOConfig(layout=layout), ctx) == {"policy_model": Path("out")}
        assert calls == [True, False] and logged == [{"rank_restarts": 1}]  # the drill fires once

        def always(cfg, ctx, drills):
            calls.append(drills)
            raise ray.exceptions.RayActorError()

        calls.clear()
        monkeypatch.setattr(ppo, "_run", always)
        with pytest.raises(ray.exceptions.RayActorError):
            ppo.run(PPOConfig(layout=layout), ctx)
        assert len(calls) == MAX_RESTARTS + 1

        def broken(cfg, ctx, drills):
            calls.append(drills)
            raise ValueError("a bug")

        calls.clear()
        monkeypatch.setattr(ppo, "_run", broken)
        with pytest.raises(ValueError):
            ppo.run(PPOConfig(layout=layout), ctx)
        assert calls == [True]  # an error in live code is not retried


class _Method:
    def __init__(self, log, who):
        self.log, self.who = log, who

    def remote(self, *args, **kwargs):
        self.log.append((self.who, args, kwargs))
        return (self.who, args)


def test_the_colocated_layout_generates_each_ranks_share_on_its_own_engine_and_retries_nothing():
    from stages.ppo.config import PPOConfig
    from stages.ppo.layouts.colocated import Colocated

    log = []
    layout = Colocated(PPOConfig(layout="colocated", policy={"num_ranks": 2}))
    layout.ranks_group = SimpleNamespace(actors=[SimpleNamespace(engine_generate=_Method(log, r)) for r in (0, 1)])
    prompts = [{"prompt_ids": [i]} for i in range(3)]
    refs = layout.rollouts(prompts, {"n": 2})
    assert [who for who, _ in refs] == [0, 1] and [args[0] for _, args in refs] == [[[0], [1]], [[2]]]
    calls = []

    def fails():
        calls.append(1)
        raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError):
        layout.retrying(fails)
    assert calls == [1] and layout.restarts == 0


def test_the_separate_layout_sends_shares_through_the_policy_ranks_and_lets_the_pool_retry():
    from stages.ppo.config import PPOConfig
    from stages.ppo.layouts.separate import Separate

    sent = {}

    class Policy:
        actors = [0, 1]

        def __len__(self):
            return 2

        def run_each(self, method, per_rank, **kw):
            sent.update(method=method, per_rank=per_rank, **kw)
            return ["ref0", "ref1"]

    retried = []
    pool = SimpleNamespace(engines=["e0"], restarts=3,
                           retrying=lambda call, say, since: retried.append(since) or call())
    layout = Separate(PPOConfig())
    layout.groups, layout.pool = {"policy": Policy()}, pool
    assert layout.rollouts([{"prompt_ids": [i]} for i in range(3)], {"n": 1}) == ["ref0", "ref1"]
    assert sent == {"method": "generate", "per_rank": [[[0], [1]], [[2]]], "engines": ["e0"], "sampling": {"n": 1}}
    assert layout.retrying(lambda: "done", since=2) == "done" and retried == [2] and layout.restarts == 3
