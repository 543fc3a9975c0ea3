"""`SeparateRank`: a rank of any role in the separate layout (stages/ppo/layouts/separate.py); a policy rank sends
its prompt share to the engine actors (`generate`).
"""

from __future__ import annotations

import ray

from stages.ppo.worker import PPOWorker


class SeparateRank(PPOWorker):
    """A `PPOWorker` that drives engine actors. `generate` runs in its own Ray concurrency group: it only waits on
    the engines, so with `rollout.async` a policy rank sends the next iteration's prompts while it trains on this
    one."""

    CONCURRENCY_GROUPS = {"rollout": 1}

    @ray.method(concurrency_group="rollout")
    def generate(self, prompt_ids: list[list[int]], engines: list, sampling: dict, rows: list[dict] | None = None,
                 episode=None) -> list[list[dict]]:
        """This rank's prompts, spread over its engines: rank r uses engines r, r+W, r+2W, ... (or r mod N).

        Any rank can call any engine: with fewer engines than ranks several ranks share one;
        with more, each rank drives several concurrently. With `episode` (an EpisodeSpec) each sample is a
        multi-turn episode against its environment, which receives the prompt's row.
        """
        import ray

        from stages.ppo.groups import shard

        mine = [e for i, e in enumerate(engines) if i % self.world == self.rank % len(engines)] \
            if len(engines) >= self.world else [engines[self.rank % len(engines)]]
        parts = shard(prompt_ids, len(mine))
        if episode is not None:  # followed: an engine stalled by the environment is killed (EngineStalled)
            from stages.ppo.episodes import run_episodes

            return run_episodes(mine, parts, shard(rows, len(mine)), sampling, episode)
        outs = ray.get([e.generate.remote(p, sampling) for e, p in zip(mine, parts) if p])
        return [s for part in outs for s in part]
