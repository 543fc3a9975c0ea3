"""Planning: which stages a run has, their cache keys, and for each whether it is a hit or a miss and why.

    plan = build_plan(cfg, only=["data"])      # keys, hit/miss and why; reads files, writes and starts nothing

A stage's key hashes everything its output depends on (`components`): its config section and the
sections it reads, its code, library versions, its upstream stages' keys and its raw input files.
`pipeline.runner` runs the plan; `pipeline plan` prints it.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import artifacts, storage
from pipeline.config import PipelineConfig, flatten, get_path, to_plain, with_values
from pipeline.errors import UserError
from pipeline.registry import STAGES, StageSpec, stages_for
from pipeline.registry import load as load_stage
from pipeline.tracking import redact

FORCED = "forced (--force)"  # the reason of a stage the user forced: it reruns from scratch


@dataclass
class PlannedStage:
    spec: StageSpec
    key: str | None  # None: not knowable yet (it takes the values of a sweep that has not run)
    components: dict
    status: str  # "hit", "miss" or "skip" (not selected)
    reason: str
    finished: bool  # a finished artifact exists for this key
    config: Any = None  # the stage's config section as it runs (with tuned values applied, if it uses them)
    found: storage.Lookup | None = None  # where its artifact was when planned: the run uses it, not a second look

    @property
    def pending(self) -> bool:
        """Its key waits for an upstream outcome (a sweep's best values); it is keyed when it is reached."""
        return self.key is None


def ordered(stages: tuple[StageSpec, ...] = STAGES) -> list[StageSpec]:
    """Stages in dependency order (producers before consumers)."""
    producer = {o: s.name for s in stages for o in s.outputs}
    done: list[StageSpec] = []
    pending = list(stages)
    while pending:
        ready = [s for s in pending if all(producer.get(i) in {d.name for d in done} for i in s.inputs)]
        if not ready:
            raise RuntimeError(f"registry has a cycle or a missing producer among {[s.name for s in pending]}")
        done.extend(ready)
        pending = [s for s in pending if s not in ready]
    return done


def _upstream(spec: StageSpec, stages: list[StageSpec]) -> list[str]:
    producer = {o: s.name for s in stages for o in s.outputs}
    return sorted({producer[i] for i in spec.inputs})


def _closure(names: set[str], stages: list[StageSpec], downstream: bool) -> set[str]:
    """`names` plus every stage upstream (or downstream) of them."""
    out, changed = set(names), True
    while changed:
        changed = False
        for s in stages:
            ups = set(_upstream(s, stages))
            if downstream and s.name not in out and ups & out:
                out.add(s.name)
                changed = True
            if not downstream and s.name in out and not ups <= out:
                out |= ups
                changed = True
    return out


def select(stages: list[StageSpec], only=(), from_=None, to=None) -> set[str]:
    """The names `--only`, or `--from`/`--to`, select; a UserError for an unknown name (with the closest
    one) or a range that selects nothing (`--from ppo --to sft`: ppo is downstream of sft)."""
    names = [s.name for s in stages]
    for n in [*only, from_, to]:
        if n is not None and n not in names:
            close = difflib.get_close_matches(n, names, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UserError(f"unknown stage '{n}'; {hint}stages are: {', '.join(names)}")
    if only:
        if from_ or to:
            raise UserError("--only cannot be combined with --from/--to")
        return set(only)
    chosen = set(names)
    if from_:
        chosen &= _closure({from_}, stages, downstream=True)
    if to:
        chosen &= _closure({to}, stages, downstream=False)
    if not chosen:
        raise UserError(f"--from {from_} --to {to} selects no stage: '{to}' does not depend on '{from_}' "
                        f"(stages in order: {', '.join(names)}); swap them, or use --only {from_},{to}")
    return chosen


_FUNCTION_SPEC = re.compile(r"^([A-Za-z_][\w.]*):[A-Za-z_]\w*$")


def named_modules(config: dict, reads: tuple[str, ...]) -> list[str]:
    """Modules named as 'module:function' by the settings a stage reads from elsewhere in the config (a
    custom `task.verifier`, a gold preference): their code changes the stage's results like its own."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, str) and (m := _FUNCTION_SPEC.match(value)):
            found.append(m.group(1))

    for p in reads:
        walk(config.get(p))
    return found


def components(cfg: PipelineConfig, spec: StageSpec, upstream_keys: dict[str, str], fps, stage_cfg: Any = None) -> dict:
    """Everything a stage's output depends on; its hash is the cache key.

    `stage_cfg` is the stage's own section as it will run (tuned values applied), if not the YAML's.
    """
    stage = load_stage(spec.module)
    section = stage_cfg if stage_cfg is not None else get_path(cfg, spec.config)
    raw = stage.raw_inputs(cfg)
    # A password in a URI (a database tracking store's, read by serve) is not part of what the stage
    # computes: dropped, so it reaches no manifest or attempt.json, and changing it reruns nothing.
    config = {p: redact(to_plain(get_path(cfg, p)), mask=None) for p in (spec.config, *spec.reads)}
    config[spec.config] = redact(to_plain(section), mask=None)
    for p in spec.reads:  # whether a swept stage takes the sweep's values does not change the sweep
        if isinstance(config[p], dict):
            config[p].pop("use_tuned", None)
    for dotted in spec.ignores:  # e.g. task.verifier for the stages that generate the task
        section, _, key = dotted.rpartition(".")
        if isinstance(config.get(section), dict):
            config[section].pop(key, None)
    code = {}
    for name in (spec.module, *spec.code, *stage.configured_code(section), *named_modules(config, spec.reads)):
        code.update(artifacts.code_fingerprint(name))
    return {
        "stage": spec.name,
        "config": config,
        "code": code,
        "libraries": artifacts.library_versions(),
        "upstream": upstream_keys,
        "raw_inputs": fps.paths([Path(p) for p in raw]),
    }


def _diff(old: dict, new: dict) -> str:
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(changed[:3]) + (f" (+{len(changed) - 3} more)" if len(changed) > 3 else "")


def explain_miss(last: dict | None, key: str, comps: dict) -> str:
    """Why a stage has no artifact for this key, compared with its last attempt (`Lookup.last_attempt`)."""
    if not last:
        return "never run"
    if last.get("key") == key:
        return "last attempt did not finish (no manifest)"
    old = last.get("components", {})
    reasons = []
    if old.get("config") != comps["config"]:
        reasons.append("config changed: " + _diff(flatten(old.get("config", {})), flatten(comps["config"])))
    if old.get("code") != comps["code"]:
        reasons.append("code changed: " + _diff(old.get("code", {}), comps["code"]))
    if old.get("libraries") != comps["libraries"]:
        reasons.append("libraries changed: " + _diff(old.get("libraries", {}), comps["libraries"]))
    if old.get("upstream") != comps["upstream"]:
        reasons.append("upstream changed: " + _diff(old.get("upstream", {}), comps["upstream"]))
    if old.get("raw_inputs") != comps["raw_inputs"]:
        reasons.append("raw inputs changed: " + _diff(old.get("raw_inputs", {}), comps["raw_inputs"]))
    return "; ".join(reasons) or "changed"


def tuned_values(store: storage.ArtifactStore, sweep: str, key: str) -> dict | None:
    """The finished sweep's best values ({field path: value}), or None if it has not run: `best_config` of
    the stage `sweep` under `key`.

    Read from the bucket when only the bucket has the sweep (planning writes nothing locally)."""
    raw = store.read_output(sweep, key, "best_config")
    try:
        best = json.loads(raw) if raw else None
    except ValueError:
        return None
    return best["params"] if isinstance(best, dict) and "params" in best else None


class Planner:
    """Keys stages one at a time, in order, from the keys of the stages upstream of them.

    `build_plan` keys every stage once, up front. A stage that takes a sweep's best values
    (`use_tuned`) is keyed on those values, not on the sweep's key, so it reruns exactly when the
    best values change; before the sweep has run its key is unknown (None), and so is every key
    downstream of it: `run_pipeline` keys those (and only those) again when it reaches them.
    `keyed` counts the keyings per stage (a test holds the run to one each).
    """

    def __init__(self, cfg: PipelineConfig, stages: list[StageSpec], chosen: set[str], forced: set[str],
                 store: storage.ArtifactStore):
        self.cfg, self.stages, self.chosen, self.forced, self.store = cfg, stages, chosen, forced, store
        self.fps = store.fps
        self.producer = {o: s.name for s in stages for o in s.outputs}
        self.keys: dict[str, str | None] = {}
        self.keyed: dict[str, int] = {}

    def key(self, spec: StageSpec) -> PlannedStage:
        cfg = self.cfg
        self.keyed[spec.name] = self.keyed.get(spec.name, 0) + 1
        status_if = (lambda status: status if spec.name in self.chosen else "skip")
        upstream = {i: self.keys[self.producer[i]] for i in spec.inputs}
        stage_cfg = get_path(cfg, spec.config)
        if "best_config" in spec.inputs and upstream["best_config"] is not None:
            values = tuned_values(self.store, self.producer["best_config"], upstream["best_config"])
            if values is None:
                upstream["best_config"] = None
            else:
                upstream["best_config"] = artifacts.hash_json(values)
                try:
                    stage_cfg = with_values(stage_cfg, values, prefix=spec.config)
                except ValueError as exc:
                    raise UserError(f"{spec.config}.use_tuned: the sweep's best values do not fit the current "
                                    f"config ({exc}); rerun the sweep (--force {self.producer['best_config']}) or "
                                    "set use_tuned: false") from None
        unknown = sorted(self.producer[i] for i, k in upstream.items() if k is None)
        if unknown:
            self.keys[spec.name] = None
            sweep = self.producer.get("best_config")
            why = (f"waits for the {sweep} stage's best values (keyed once the sweep has run)" if unknown == [sweep]
                   else f"keyed once {' and '.join(unknown)} {'has' if len(unknown) == 1 else 'have'} run")
            return PlannedStage(spec, None, {"upstream": upstream}, status_if("miss"), why, False, stage_cfg)
        comps = components(cfg, spec, upstream, self.fps, stage_cfg)
        key = self.keys[spec.name] = artifacts.hash_json(comps)
        found = self.store.lookup(spec.name, key)
        finished = found.found
        always = load_stage(spec.module).always_runs(stage_cfg)
        if spec.name in self.chosen and spec.name in self.forced:
            status, reason = "miss", FORCED
        elif always:
            status, reason = "miss", always
        elif finished:
            status, reason = "hit", f"cached ({key})" if found.where == "here" else (
                f"cached in {self.store.bucket.uri} ({key})" + (f"; here: {found.problem}" if found.problem else ""))
        else:
            status, reason = "miss", found.problem or explain_miss(found.last_attempt, key, comps)
        return PlannedStage(spec, key, comps, status_if(status), reason, finished, stage_cfg, found)


def selection(cfg: PipelineConfig, only=(), from_=None, to=None, force=(),
              registry: tuple[StageSpec, ...] | None = None) -> tuple[list[StageSpec], set[str], set[str]]:
    """(stages in order, the selected names, the forced names); the one place a selection is validated.

    A bad stage name (in --only, --from, --to or --force) is a UserError naming the valid ones."""
    stages = ordered(registry or stages_for(cfg))
    chosen = select(stages, only, from_, to)
    forced = {s.name for s in stages} if "all" in force else set(force)
    for name in forced:
        select(stages, only=[name])  # validates the name
    return stages, chosen, forced


def build_plan(cfg: PipelineConfig, only=(), from_=None, to=None, force=(),
               registry: tuple[StageSpec, ...] | None = None, planner: Planner | None = None) -> list[PlannedStage]:
    """Cache key, hit/miss and the reason for every stage. Reads files, writes and starts nothing.

    With `planner` (already holding a validated selection) the selection arguments are not used."""
    if planner is None:
        planner = Planner(cfg, *selection(cfg, only, from_, to, force, registry), storage.ArtifactStore.of(cfg))
    plan = [planner.key(spec) for spec in planner.stages]
    _check_needed(plan, planner.chosen)
    return plan


def _check_needed(plan: list[PlannedStage], chosen: set[str]) -> None:
    """Selected stages whose inputs come from unselected stages need those artifacts to exist."""
    by_name = {p.spec.name: p for p in plan}
    stages = [p.spec for p in plan]
    for p in plan:
        if p.spec.name not in chosen:
            continue
        for up in _upstream(p.spec, stages):
            upp = by_name[up]
            if up not in chosen and not upp.finished:
                raise UserError(
                    f"stage '{p.spec.name}' needs the output of stage '{up}', which has not been run with "
                    f"this configuration ({upp.reason}); run it first: add it to --only, or use --from {up}"
                )
