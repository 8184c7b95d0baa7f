"""Dependencies follow the layers: the spec, the reference and the machines driving a pure-Python target import
neither torch, numpy, cffi nor the C extension (each probe runs in a fresh interpreter)."""

import subprocess
import sys
import textwrap

import pytest

# what an installed wheel must do: CI runs this module against the wheel too (.ci/installed)
pytestmark = pytest.mark.installed

HEAVY = "('torch', 'numpy', 'cffi', '_cffi_backend', 'radixspec.optimized')"

CHECK = f"""
heavy = sorted(name for name in sys.modules if name.split('.')[0] in {HEAVY} or name.startswith({HEAVY}))
assert not heavy, f'imported: {{sorted({{name.split(".")[0] for name in heavy}})}} ({{len(heavy)}} modules)'
"""


def run_probe(body: str) -> None:
    probe = "import sys\n" + textwrap.dedent(body) + CHECK
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_importing_the_package_the_spec_the_reference_and_the_fuzz_layer_loads_no_torch() -> None:
    run_probe(
        """
        import radixspec, radixspec.spec, radixspec.reference, radixspec.fuzz
        import radixspec.fuzz.machines, radixspec.fuzz.campaign, radixspec.fuzz.targets.api
        from radixspec.fuzz import commands
        commands.versions()
        """
    )


def test_a_campaign_over_the_reference_loads_no_torch_nor_the_c_tree() -> None:
    run_probe(
        """
        from radixspec.fuzz import campaign
        status = campaign.main(['--target', 'reference', '--machine', 'cache', '--examples', '5',
                                '--workers', '0', '--quiet', '--seed', '1', '--out', 'out'])
        assert status == 0, status
        status = campaign.main(['--target', 'reference', '--machine', 'manager', '--examples', '5',
                                '--workers', '0', '--quiet', '--seed', '1', '--out', 'out'])
        assert status == 0, status
        """
    )


def test_a_machine_run_under_pytest_over_a_pure_python_cache_loads_no_torch() -> None:
    run_probe(
        """
        from hypothesis import settings
        from radixspec.fuzz.machines import machine_for
        machine = machine_for('hybrid', ('reference',))
        machine.TestCase.settings = settings(max_examples=5, stateful_step_count=10, database=None)
        machine.TestCase().runTest()
        """
    )


def test_the_probe_sees_torch_when_it_is_imported() -> None:
    """The check itself can fail: an optimized target does load torch."""
    probe = "import sys\nfrom radixspec.fuzz.targets.ours import OPTIMIZED\nOPTIMIZED.cache_factory(1, 4)\n" + CHECK
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "imported: [" in proc.stderr and "torch" in proc.stderr
