"""``Engine``: run a list of requests to completion; outputs per request and a stats line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixspec.spec.metrics import CacheStats, stats_of
from radixspec.spec.requests import RequestSpec, SchedulerConfig, SchedulerStats, StepReport

from .model import HashModel
from .scheduler import Scheduler


@dataclass
class EngineResult:
    """What a run produced."""

    # uid -> generated tokens
    outputs: dict[int, list[int]]
    stats: SchedulerStats
    evicted_pages: int
    # the prefix cache's metrics (spec/metrics.py): hit rates, pages stored / evicted, eviction age
    cache: CacheStats = field(default_factory=CacheStats)

    def summary(self) -> str:
        s = self.stats
        return (
            f"requests {s.admitted}  steps {s.steps} (prefill {s.prefill_batches}, decode {s.decode_batches})"
            f"  prompt tokens {s.prompt_tokens}  prefix hits {s.prefix_hit_tokens} ({100 * s.hit_rate:.1f}%)"
            f"  generated {s.generated_tokens}  evicted pages {self.evicted_pages}"
            f"  peak pages in use {s.peak_pages_in_use}"
        )


class Engine:
    """A scheduler with a HashModel: the whole request lifecycle, checked for KV corruption at every read."""

    def __init__(self, config: SchedulerConfig, model: HashModel | None = None) -> None:
        self.config = config
        self.model = model or HashModel(eos_token_id=config.eos_token_id)
        self.scheduler = Scheduler(config, self.model)

    def generate(
        self,
        requests: list[RequestSpec],
        check_every: int = 0,
        on_step: Callable[[StepReport], None] | None = None,
    ) -> EngineResult:
        """Run every request to completion; ``check_every`` > 0 runs check_integrity every that many steps;
        ``on_step`` sees each step's report (the tokens it produced), e.g. to time requests."""
        for spec in requests:
            self.scheduler.add_request(spec.uid, spec.input_ids, spec.max_tokens, spec.ignore_eos, spec.namespace)
        while not self.scheduler.idle:
            report = self.scheduler.step()
            if on_step is not None:
                on_step(report)
            if check_every and self.scheduler.stats.steps % check_every == 0:
                self.scheduler.check_integrity()
        self.scheduler.check_integrity()
        return EngineResult(
            {uid: list(tokens) for uid, tokens in self.scheduler.outputs.items()},
            self.scheduler.stats,
            self.scheduler.cache_manager.evicted_pages,
            stats_of(self.scheduler.cache_manager.prefix_cache),
        )
