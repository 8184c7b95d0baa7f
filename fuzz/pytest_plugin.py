"""The pytest plugin (entry point ``pytest11``: ``radixspec``): options for the machines of ``radixspec.testing``
and the campaign's targets as test items.

    pytest --radixspec-target mypkg.cache:MyCache       # each machine the target has, as one test item each
    pytest --radixspec-examples 500 --radixspec-seed 7  # for every radixspec machine of the run

``--radixspec-examples``, ``--radixspec-steps`` and ``--radixspec-seed`` apply to radixspec's machines only;
the user's own Hypothesis tests and profiles are left alone. ``--radixspec-seed random`` draws a fresh seed,
printed in the header so that a run reproduces. A failure writes its regression file into ``--radixspec-out``.

Light on purpose: pytest loads this module in every run of an environment where radixspec is installed, so it
imports no machine, no Hypothesis and no torch until a radixspec test runs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .options import options

if TYPE_CHECKING:
    from .targets.api import TargetInfo


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {text}")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("radixspec", "radixspec: the prefix-cache state machines")
    group.addoption(
        "--radixspec-target",
        action="append",
        default=[],
        metavar="NAME",
        help="run radixspec's machines against this target (as radixspec fuzz --target takes it: a built-in,"
        " module:attribute or an entry point); one test item per machine it has; repeatable",
    )
    group.addoption("--radixspec-examples", type=positive, default=None, metavar="N", help="examples per machine")
    group.addoption("--radixspec-steps", type=positive, default=None, metavar="N", help="steps per example")
    group.addoption(
        "--radixspec-seed",
        default=None,
        metavar="SEED|random",
        help="every radixspec machine draws from this seed ('random': a fresh one, printed in the header)",
    )
    group.addoption(
        "--radixspec-shrink-seconds",
        type=float,
        default=60.0,
        metavar="S",
        help="how long shrinking a radixspec machine's failure may take (then the smallest found is reported)",
    )
    group.addoption(
        "--radixspec-out", default="fuzz-failures", metavar="DIR", help="where a failure's regression file goes"
    )


def pytest_configure(config: pytest.Config) -> None:
    seed = config.getoption("radixspec_seed")
    if seed == "random":
        seed = random.SystemRandom().randrange(2**32)
    elif seed is not None:
        try:
            seed = int(seed)
        except ValueError:
            raise pytest.UsageError(f"--radixspec-seed takes an integer or 'random', got {seed!r}") from None
    options.seed = seed
    options.examples = config.getoption("radixspec_examples")
    options.steps = config.getoption("radixspec_steps")
    options.out = Path(config.getoption("radixspec_out"))
    options.shrink_seconds = config.getoption("radixspec_shrink_seconds")


def pytest_report_header(config: pytest.Config) -> str | None:
    if options.seed is None and options.examples is None and not config.getoption("radixspec_target"):
        return None
    import radixspec

    said = [f"radixspec {radixspec.__version__}: seed {options.seed if options.seed is not None else '(Hypothesis)'}"]
    said += [f"examples {options.examples}"] if options.examples is not None else []
    said += (
        [f"targets {', '.join(config.getoption('radixspec_target'))}"] if config.getoption("radixspec_target") else []
    )
    return ", ".join(said)


class MachineItem(pytest.Item):
    """One radixspec machine driving the spec beside a named target."""

    def __init__(self, *, layer: str, target: str, info: TargetInfo, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layer, self.target, self.info = layer, target, info

    def runtest(self) -> None:
        from .testing import user_machine

        user_machine(self.layer, self.info, None, None).TestCase().runTest()

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"radixspec {self.layer} machine against {self.target}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    names = config.getoption("radixspec_target")
    if not names:
        return
    from .targets import TargetError, resolve
    from .targets.layers import layers_of

    for name in names:
        try:
            info = resolve(name)
        except TargetError as exc:
            raise pytest.UsageError(f"--radixspec-target {name}: {exc}") from None
        # every layer of the target that a user's tests drive (fuzz/targets/layers.py)
        for layer in [layer.name for layer in layers_of(info) if layer.user]:
            items.append(
                MachineItem.from_parent(session, name=f"radixspec[{layer}:{name}]", layer=layer, target=name, info=info)
            )
