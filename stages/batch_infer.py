"""Batch inference: completions for a prompts dataset through Ray Data and vLLM, scored, as Parquet.

    prompts (any file the data stage reads, through its readers; default: the data stage's held-out prompts)
      -> Ray Data LLM processor (`ray.data.llm`): chat template -> tokenize -> vLLM engine(s) -> detokenize
      -> [verifier: the task's answer check]  [reward model: a Ray Data actor scoring each completion]
      -> Parquet: <out>/predictions (one row per prompt) + summary.json

The engine is built from the same `EngineConfig` as the serving stage, so a batch job answers as the
API does. A row that cannot be answered (a prompt longer than the context, an empty prompt) is kept
with its `error` column set (`should_continue_on_error`), counted in the summary and shown, never
silently dropped: the output has exactly one row per input row.

Two ways to run it:
    python -m pipeline run configs/full.yaml --only batch_infer           # a pipeline stage (cached)
    python -m pipeline batch-infer configs/full.yaml --model models:/posttrain-policy@champion \\
        --prompts prompts.jsonl                                           # a registered model, any file
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from pipeline.errors import UserError
from pipeline.schema import Section
from stages.common.serving import EngineConfig, check_source
from stages.data.files import SUFFIXES, file_type

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext

SOURCE_COLUMN = "__source__"  # the input row, carried through the processor as JSON


class SamplingConfig(Section):
    """How completions are sampled."""

    max_tokens: int = Field(32, ge=1, description="Tokens generated per prompt at most.")
    temperature: float = Field(0.0, ge=0, description="0: greedy; higher: more random.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")


class ScoreConfig(Section):
    """How completions are scored (summary: accuracy, mean reward)."""

    verifier: bool = Field(True, description="Check each completion's final integer against the row's answer "
                           "(the task verifier); rows without an answer are not scored.")
    reward_model: bool = Field(False, description="Score each (prompt, completion) with the pipeline's reward model "
                               "(an ensemble, stages.reward.heads > 1: the heads' mean).")


class BatchInferConfig(Section):
    """Offline generation over a prompts dataset with the served model's engine settings."""

    source: Literal["policy_model", "dpo_model", "sft_model", "base_model"] = Field(
        "policy_model", description="Which pipeline model answers (as a stage; the CLI's --model overrides it).")
    prompts: Path | None = Field(None, description="A file (JSON Lines or a JSON array, also gzipped; Parquet; CSV), "
                                 "a directory of them or of Parquet shards, with one prompt per row, read as the data "
                                 "stage reads its sources (docs/data.md). Empty: the data stage's held-out prompts.")
    prompt_field: str = Field("prompt", min_length=1, description="Column holding the prompt text.")
    answer_field: str = Field("answer", min_length=1,
                              description="Column holding the reference answer (for the verifier).")
    chat: bool = Field(True, description="Wrap each prompt as a user turn with the model's chat template; "
                       "false: complete the raw text.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine settings.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling settings.")
    score: ScoreConfig = Field(default_factory=ScoreConfig, description="Scoring of the completions.")
    concurrency: int = Field(1, ge=1, description="vLLM engines (Ray Data actors) generating in parallel.")
    batch_size: int = Field(16, ge=1, description="Rows per batch sent to an engine.")

    @field_validator("prompts")
    @classmethod
    def _readable(cls, v: Path | None) -> Path | None:
        if v is None:
            return None
        v = v.expanduser().absolute()
        if not v.exists():
            raise ValueError(f"prompts file not found: {v} (relative paths start at the current directory)")
        if v.is_file() and not file_type(v):
            raise ValueError(f"{v.name}: unsupported format; use one of {', '.join(SUFFIXES)}")
        if v.is_dir() and not any(p.is_file() and file_type(p) for p in v.rglob("*")):
            raise ValueError(f"{v}: a directory must hold files of one of {', '.join(SUFFIXES)}")
        return v


def check(pipeline_cfg) -> None:
    """The stage's `check` hook: its source is a model the pipeline makes; scoring with the reward model needs one."""
    batch = pipeline_cfg.stages.batch_infer
    if batch is None:
        return
    check_source("stages.batch_infer.source", batch.source, pipeline_cfg.stages)
    if batch.score.reward_model and pipeline_cfg.stages.reward is None:
        raise ValueError("stages.batch_infer.score.reward_model is true but stages.reward is null; set it to false")


def wire(spec, pipeline_cfg, stages: tuple) -> tuple:
    """The stage's `wire` hook: its source model, the pipeline's held-out prompts unless it has its own file,
    and the reward model when it scores with it."""
    batch = pipeline_cfg.stages.batch_infer
    inputs = (batch.source, *(("prompt_data",) if batch.prompts is None else ()),
              *(("reward_model",) if batch.score.reward_model else ()))
    return (*stages, replace(spec, inputs=inputs))


def raw_inputs(pcfg) -> list[Path]:
    """The prompts file is part of the stage's cache key: new prompts rerun it."""
    section = pcfg.stages.batch_infer
    return [section.prompts] if section is not None and section.prompts is not None else []


# --------------------------------------------------------------------------- pure helpers


def request(row: dict, cfg: BatchInferConfig) -> dict:
    """An input row -> the processor's request (chat messages or raw prompt, sampling), the row carried as JSON."""
    text = row.get(cfg.prompt_field)
    problem = "" if isinstance(text, str) and text.strip() else f"{cfg.prompt_field!r} is empty or not text"
    sampling = {"max_tokens": cfg.sampling.max_tokens if not problem else 1, "temperature": cfg.sampling.temperature,
                "top_p": cfg.sampling.top_p}
    source = json.dumps({**{k: _plain(v) for k, v in row.items()}, "__problem__": problem}, default=str)
    body = {"messages": [{"role": "user", "content": text if not problem else "?"}]} if cfg.chat \
        else {"prompt": text if not problem else "?"}
    return {**body, "sampling_params": sampling, SOURCE_COLUMN: source}


def _plain(v: Any) -> Any:
    return v.tolist() if hasattr(v, "tolist") else v


def result(row: dict) -> dict:
    """A processor output row (success or error) -> the input row + completion, token counts, error, and
    the engine's timing of the row (`latency_s`, `answered_at`; empty for a row the engine did not answer)."""
    source = json.loads(row[SOURCE_COLUMN])
    problem = source.pop("__problem__", "")
    error = problem or str(row.get("__inference_error__") or "")
    if error == "nan":  # a success row in a block that also holds an error row
        error = ""
    latency, answered = _number(row.get("latency_s")), _number(row.get("answered_at"))
    timed = latency is not None and latency >= 0 and answered is not None
    return {**source, "completion": "" if error else str(row.get("generated_text") or ""),
            "num_input_tokens": 0 if error else int(row.get("num_input_tokens") or 0),
            "num_generated_tokens": 0 if error else int(row.get("num_generated_tokens") or 0), "error": error,
            "latency_s": latency if timed else None, "answered_at": answered if timed else None}


def _number(v: Any) -> float | None:
    """A finite float, or None (absent, or NaN where a block mixes rows with and without the column)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def verified(batch, answer_field: str, verifier: str = "number"):
    """Adds `correct` (1.0 / 0.0; empty without an answer or on error) by the task verifier (a pandas batch)."""
    from stages.common.verifiers import verifier_function

    import pandas as pd

    verify = verifier_function(verifier)
    answers = batch[answer_field] if answer_field in batch else [None] * len(batch)
    out = []
    for completion, answer, error in zip(batch["completion"], answers, batch["error"]):
        ok = not pd.isna(answer) and str(answer) != "" and not error
        out.append(float(verify(completion, str(answer))) if ok else None)
    batch["correct"] = out
    return batch


def generation_span(rows: list[dict]) -> tuple[float, float] | None:
    """(first request's start, last answer's end) as Unix times, over the rows the engine answered: the
    generation alone. Ray's start, reading the prompts and the engine's build all come before the first
    request, so a throughput over this span is the engine's, whatever the start-up cost. A row's request
    started when its answer left the engine (`answered_at`) less the engine's time for it (`latency_s`,
    Ray Data LLM's `time_taken_llm`); None when no row was answered."""
    timed = [(r["answered_at"] - r["latency_s"], r["answered_at"]) for r in rows
             if r.get("answered_at") is not None and r.get("latency_s") is not None]
    if not timed:
        return None
    return min(start for start, _ in timed), max(end for _, end in timed)


def summarize(rows: list[dict], started: float, finished: float) -> dict[str, float]:
    """The run's figures: rows, failures, generated tokens; its time (`wall_s`, from `started`, before Ray
    and the engine started, to `finished`) split into `startup_s` (to the first request) and `generation_s`
    (`generation_span`), and the throughput of the generation alone, `generation_tokens_per_s`; accuracy
    and mean reward over the rows that have them."""
    ok = [r for r in rows if not r["error"]]
    tokens = sum(int(r["num_generated_tokens"]) for r in ok)
    wall = finished - started
    span = generation_span(rows)
    generation = span[1] - span[0] if span else 0.0
    out = {"rows": len(rows), "rows_failed": len(rows) - len(ok), "generated_tokens": tokens, "wall_s": wall,
           "startup_s": max(span[0] - started, 0.0) if span else wall, "generation_s": generation,
           "generation_tokens_per_s": tokens / generation if generation > 0 else 0.0}
    scored = [r["correct"] for r in ok if r.get("correct") is not None]
    if scored:
        out.update(accuracy=sum(scored) / len(scored), accuracy_rows=len(scored))
    rewards = [r["reward"] for r in ok if r.get("reward") is not None]
    if rewards:
        out["mean_reward"] = sum(rewards) / len(rewards)
    return out


# --------------------------------------------------------------------------- Ray Data parts


class RewardScorer:
    """A Ray Data actor: the reward model's score of each (prompt, completion), formatted as in its training."""

    def __init__(self, reward_dir: str, prompt_field: str):
        import torch

        from stages.common.models import load_model, load_tokenizer, saved_heads

        torch.set_num_threads(1)
        self.tok = load_tokenizer(reward_dir)
        self.model = load_model(reward_dir, "sequence", self.tok.pad_token_id, saved_heads(reward_dir)).eval()
        self.prompt_field = prompt_field

    def __call__(self, batch):
        from stages.common.training import ensemble_score, reward_scores

        rewards: list[float | None] = [None] * len(batch)
        prompts, completions = list(batch[self.prompt_field]), list(batch["completion"])
        todo = [i for i, e in enumerate(batch["error"]) if not e]
        if todo:
            pairs = [(prompts[i], completions[i]) for i in todo]
            for i, heads in zip(todo, reward_scores(self.model, self.tok, pairs, micro=len(pairs))):
                rewards[i] = ensemble_score(heads)  # an ensemble's mean
        batch["reward"] = rewards
        return batch


def read_prompts(path: Path, prompt_field: str, run_storage=None):
    """The prompts as a Ray Dataset, with a clear error when the prompt column is missing.

    Read as the data stage reads its sources (`stages.data.files`): a file it refuses (a column of an
    extension type, gzip data that ends early, a record over the caps, a link out of the directory) is
    refused here with the same message, before Ray reads anything; so is a row that is not one (no output
    row could stand for it). Parquet is then read by Ray (a run's artifact from its bucket); other files
    on the driver, where each row is checked, then handed to Ray."""
    import ray.data

    from stages.common.parquet import read_parquet
    from stages.data import files
    from stages.data.sources import list_files

    ds, rows = None, []
    try:
        found = list_files(str(path)) if path.exists() else []  # absent: a run's artifact, in its bucket only
        if all(file_type(f) == "parquet" for f in found):
            for f in found:
                files.check(f)
            ds = read_parquet(path, run_storage)
            columns = ds.columns() or []
        else:
            rows = [row for f in found for row in files.rows(f, strict=True)]
            columns = list(dict.fromkeys(k for row in rows for k in row))
    except ValueError as exc:  # safe_read.Refused, a link out, nothing to read
        raise UserError(str(exc)) from None
    if prompt_field not in columns:
        raise UserError(f"{path}: no {prompt_field!r} column (columns: {', '.join(columns) or 'none'}); "
                        f"set prompt_field to the column that holds the prompts")
    return ds if ds is not None else ray.data.from_items([{k: r.get(k) for k in columns} for r in rows])


def processor(cfg: BatchInferConfig, model_dir: Path, seed: int):
    """The Ray Data LLM processor for this config (ecosystem part: `ray.data.llm.build_processor`)."""
    from functools import partial

    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from stages.common.devices import cluster_gpus
    from stages.common.serving import engine_env, engine_kwargs

    gpu = cluster_gpus() > 0  # the cluster's GPUs, not this driver's (stages/common/devices.py)
    config = vLLMEngineProcessorConfig(
        model_source=str(model_dir),
        engine_kwargs=engine_kwargs(cfg.engine, model_dir, gpu, seed),
        runtime_env={"env_vars": engine_env(cfg.engine, gpu)},
        batch_size=cfg.batch_size, concurrency=cfg.concurrency,
        # one engine per actor; without a bundle Ray Data LLM would reserve a GPU for it
        placement_group_config={"bundles": [{"CPU": 1, **({"GPU": 1} if gpu else {})}]},
        # The engine tokenizes the (templated) prompt and detokenizes its output itself: separate tokenize
        # and detokenize stages would each start a pool of actors importing transformers, for nothing.
        chat_template_stage=cfg.chat, tokenize_stage=False, detokenize_stage=False,
        should_continue_on_error=True,
    )
    from pipeline import events

    events.record_start("vllm_engines", count=cfg.concurrency, detail="batch inference")
    # Rows that failed skip `postprocess` (Ray Data LLM returns their whole processor row instead), so
    # the postprocess only picks the columns `result` reads, and `result` runs on every row afterwards.
    return build_processor(config, preprocess=partial(request, cfg=cfg), postprocess=_outputs)


def _outputs(row: dict) -> dict:
    """The columns `result` reads, and when this answer left the engine with the engine's time for it
    (`generation_span`: the generation measured apart from the start-up)."""
    out = {k: row.get(k) for k in (SOURCE_COLUMN, "generated_text", "num_input_tokens", "num_generated_tokens")}
    return {**out, "latency_s": row.get("time_taken_llm"), "answered_at": time.time()}


# --------------------------------------------------------------------------- driver


def infer(cfg: BatchInferConfig, model_dir: Path, prompts: Path, out_dir: Path, log, reward_dir: Path | None = None,
          seed: int = 0, run_storage=None, verifier: str = "number", started: float | None = None) -> dict[str, Any]:
    """Generate, score and write `out_dir/predictions` + `out_dir/summary.json`; returns the summary.

    `log(message)` reports progress. Ray must be running. With the run's `RunStorage`, prompts that
    are a run artifact are read from its bucket (read tasks may run on any node). `started`: when the
    caller began (before it started Ray), the start of `wall_s` and `startup_s` (default: now)."""
    import pyarrow.parquet as pq

    started = time.time() if started is None else started
    ds = read_prompts(prompts, cfg.prompt_field, run_storage)
    log(f"generating for {prompts} with {model_dir} ({cfg.concurrency} engine(s), "
        f"max {cfg.sampling.max_tokens} tokens, temperature {cfg.sampling.temperature})")
    ds = processor(cfg, model_dir, seed)(ds).map(result)
    if cfg.score.verifier:
        ds = ds.map_batches(verified, fn_kwargs={"answer_field": cfg.answer_field, "verifier": verifier},
                            batch_format="pandas",
                            batch_size=cfg.batch_size)
    if cfg.score.reward_model and reward_dir is not None:
        ds = ds.map_batches(RewardScorer, fn_constructor_args=(str(reward_dir), cfg.prompt_field),
                            concurrency=1, num_cpus=1, batch_size=cfg.batch_size, batch_format="pandas")
    predictions = out_dir / "predictions"
    ds.write_parquet(str(predictions))
    finished = time.time()
    rows = pq.read_table(predictions).to_pylist()
    summary = summarize(rows, started, finished)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    failed = [r for r in rows if r["error"]]
    for r in failed[:5]:
        log(f"row failed: {str(r.get(cfg.prompt_field))[:60]!r}: {r['error'][:200]}")
    log(summary_line(summary))
    return summary


def summary_line(s: dict) -> str:
    """The summary as one console line: the generation's throughput apart from the start-up before it."""
    line = (f"{s['rows']} rows ({s['rows_failed']} failed): {s['generated_tokens']} tokens generated in "
            f"{s['generation_s']:.2f}s, {s['generation_tokens_per_s']:.1f} tokens/s; start-up {s['startup_s']:.1f}s "
            f"before the first request (Ray, the engine); {s['wall_s']:.0f}s in all")
    if "accuracy" in s:
        line += f"; accuracy {s['accuracy']:.3f} on {s['accuracy_rows']} rows"
    if "mean_reward" in s:
        line += f"; mean reward {s['mean_reward']:.3f}"
    return line


def check_not_all_failed(summary: dict, prompts) -> None:
    """A run in which every row failed produced nothing: a stage failure, never a cached result."""
    if summary["rows"] and summary["rows_failed"] == summary["rows"]:
        raise RuntimeError(f"batch_infer: all {summary['rows']} rows of {prompts} failed (the first errors are "
                           "logged above); nothing is cached")


def run(cfg: BatchInferConfig, ctx: StageContext) -> dict[str, Path]:
    """As a pipeline stage: the configured source model over the prompts; the summary goes to MLflow."""
    started = time.time()  # the stage's start-up: Ray's start (if no stage before started it), the engine's build
    prompts = cfg.prompts or ctx.inputs["prompt_data"] / "eval"
    ctx.ray()
    reward_dir = ctx.inputs.get("reward_model") if cfg.score.reward_model else None
    summary = infer(cfg, ctx.inputs[cfg.source], prompts, ctx.out_dir, ctx.progress, reward_dir, ctx.pipeline.seed,
                    ctx.storage, ctx.pipeline.task.verifier, started)
    check_not_all_failed(summary, prompts)
    ctx.progress(f"results in {ctx.out_dir / 'predictions'}")
    ctx.log_metrics(summary)
    ctx.log_artifact(ctx.out_dir / "summary.json")
    return {"predictions": ctx.out_dir / "predictions"}


# --------------------------------------------------------------------------- outside the stage graph


def infer_registered(cfg, model: str, prompts: Path | None, output: Path | None, reward_model: str | None,
                     log) -> tuple[dict[str, Any], Path]:
    """`pipeline batch-infer`: any registered model (or model directory) over any prompts file, as its
    own MLflow run; (summary, output directory).

    `cfg` is the pipeline config: `stages.batch_infer` gives the settings (defaults without it),
    `prompts` and `output` override them. Results are written into a hidden sibling and renamed
    into place on success, so a failed run never leaves a half-written `output`; an existing,
    non-empty `output` is refused (nothing is overwritten). The arguments are checked and the model
    fetched before anything else is written; Ray's, vLLM's and MLflow's output then goes to
    `<run_dir>/logs/batch-infer.log` when the command line routes it (`pipeline.console.command_log`)."""
    from pipeline import console
    from stages.common.model_registry import fetch

    section = cfg.stages.batch_infer or BatchInferConfig()
    if prompts is not None:
        from pydantic import ValidationError

        try:
            section = BatchInferConfig.model_validate({**section.model_dump(), "prompts": prompts})
        except ValidationError as exc:  # a usage error (exit 2), said as the config's errors are
            raise UserError("--prompts: "
                            + "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
    if section.prompts is None:
        raise UserError("batch-infer: no prompts; pass --prompts FILE or set stages.batch_infer.prompts")
    output = (output or cfg.run_dir / "batch_infer" / time.strftime("%Y%m%d-%H%M%S")).absolute()
    if output.exists() and any(output.iterdir()):
        raise UserError(f"--output {output}: exists and is not empty; give a new directory (nothing is overwritten)")
    cache = cfg.run_dir / "registry_cache"
    model_dir = fetch(model, cfg.tracking_uri, cache)
    reward_dir = fetch(reward_model, cfg.tracking_uri, cache) if reward_model else None
    if section.score.reward_model and reward_dir is None:
        raise UserError("stages.batch_infer.score.reward_model is on: pass --reward-model URI|DIR, or turn it off")
    # From here on Ray's, Ray Data's, vLLM's and MLflow's output goes to <run_dir>/logs/batch-infer.log (the
    # refusals above write nothing)
    with console.command_log(cfg.run_dir, "batch-infer") as log_path:
        if log_path:
            log(f"library output in {log_path}")
        return _tracked(cfg, section, model, model_dir, reward_dir, output, log)


def _tracked(cfg, section: BatchInferConfig, model: str, model_dir: Path, reward_dir: Path | None, output: Path,
             log) -> tuple[dict[str, Any], Path]:
    """`infer_registered`'s work, as its own MLflow run: Ray started (unless running), `infer` into a hidden
    sibling of `output`, renamed into place on success."""
    import shutil

    from pipeline.cluster import ensure_ray, shutdown_ray
    from pipeline.schema import flatten
    from pipeline.tracking import Tracker, log_params

    t0 = time.time()  # the command's start-up counts from here: Ray's start, the engine's build
    tracker = Tracker(cfg.tracking_uri, cfg.mlflow.experiment, cfg.run_dir, run_name="batch-infer",
                      tags={"model_uri": model, "prompts": str(section.prompts), "output": str(output)})
    log_params(tracker.client, tracker.parent_id, flatten(section.model_dump(mode="json")))
    started, status = ensure_ray(cfg.ray, log=log), "FAILED"
    tmp = output.with_name(f".{output.name}.partial")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        summary = infer(section, model_dir, section.prompts, tmp, log, reward_dir, cfg.seed, verifier=cfg.task.verifier,
                        started=t0)
        if output.exists():  # an empty directory the user made for it
            output.rmdir()
        tmp.rename(output)
        tracker.log_metrics(tracker.parent_id, summary)
        tracker.log_artifact(tracker.parent_id, output / "summary.json")
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.end(tracker.parent_id, status)
        if started:
            shutdown_ray(log)
    return summary, output


# --------------------------------------------------------------------------- the batch-infer command


def add_arguments(parser) -> None:
    """`python -m pipeline batch-infer CONFIG [--model URI] [--prompts FILE] [--output DIR] [--reward-model URI]`."""
    parser.add_argument("--model", help="models:/NAME@ALIAS or a local model directory (default: the serve stage's "
                        "registered model, models:/<stages.serve.registry.model_name>@<alias>)")
    parser.add_argument("--prompts", type=Path, help="a file of prompts: .jsonl/.json (also .gz), .parquet or .csv "
                        "(default: stages.batch_infer.prompts)")
    parser.add_argument("--output", type=Path, help="a new directory for the results (default: "
                        "<run_dir>/batch_infer/<time>)")
    parser.add_argument("--reward-model", help="a reward model (registry URI or directory) to score completions with")
    parser.add_argument("--verbose", action="store_true", help="also show library output (Ray, Ray Data, vLLM, "
                        "MLflow) live; it always goes to <run_dir>/logs/batch-infer.log")


def main(args, cfg, console) -> int:
    from stages.serve.command import default_model, logger, quiet_downloads

    quiet_downloads()
    summary, output = infer_registered(cfg, args.model or default_model(cfg), args.prompts, args.output,
                                       args.reward_model, logger("batch-infer", console))
    console.print(f"[bold green]done[/]: {summary['rows']} rows ({summary['rows_failed']} failed) in {output}")
    return 0
