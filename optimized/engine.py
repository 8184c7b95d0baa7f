"""``Engine`` on tensors. Twin of ``radixspec.reference.engine.Engine``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from radixspec.spec.metrics import CacheStats, stats_of
from radixspec.spec.requests import RequestSpec, SchedulerConfig, SchedulerStats, StepReport

from .model import HashModel
from .scheduler import Scheduler


@dataclass
class EngineResult:
    """What a run produced. Twin of ``radixspec.reference.engine.EngineResult``."""

    outputs: dict[int, list[int]]
    stats: SchedulerStats
    evicted_pages: int
    # the prefix cache's metrics (spec/metrics.py): hit rates, pages stored / evicted, eviction age
    cache: CacheStats = field(default_factory=CacheStats)


class Engine:
    """A tensor scheduler with a HashModel on an MHAKVCache. Twin of ``reference.Engine``."""

    def __init__(self, config: SchedulerConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        # the hot path stores without host syncs; generate() reads the store's error flags once at the end
        self.model = HashModel(
            config.num_pages, config.page_size, device, eos_token_id=config.eos_token_id, store_mode="fast"
        )
        self.scheduler = Scheduler(config, self.model, device)

    def generate(
        self,
        requests: list[RequestSpec],
        check_every: int = 0,
        on_step: Callable[[StepReport], None] | None = None,
    ) -> EngineResult:
        for spec in requests:
            self.scheduler.add_request(spec.uid, spec.input_ids, spec.max_tokens, spec.ignore_eos, spec.namespace)
        while not self.scheduler.idle:
            report = self.scheduler.step()
            if on_step is not None:
                on_step(report)
            if check_every and self.scheduler.stats.steps % check_every == 0:
                self.scheduler.check_integrity()
        self.scheduler.check_integrity()
        self.model.pool.check_store_errors()
        return EngineResult(
            {uid: list(tokens) for uid, tokens in self.scheduler.outputs.items()},
            self.scheduler.stats,
            self.scheduler.cache_manager.evicted_pages,
            stats_of(self.scheduler.cache_manager.prefix_cache),
        )
