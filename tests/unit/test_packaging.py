"""The declared dependency ranges agree with what install() accepts and with what CI tests."""

import configparser
import os
import re

from megatron_offload import compat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    return cfg


def _lines(value):
    return [line.strip() for line in value.strip().splitlines() if line.strip()]


def test_a_plain_install_never_moves_torch_or_brings_megatron():
    """torch without bounds, megatron-core not required: `pip install megatron-offload` into an
    existing Megatron environment (an NGC container's torch build) leaves both as they are."""
    cfg = _setup_cfg()
    assert _lines(cfg["options"]["install_requires"]) == ["torch"]
    assert cfg["options"]["python_requires"].strip() == ">=3.12"


def test_the_megatron_extra_is_the_supported_range():
    extra = _lines(_setup_cfg()["options.extras_require"]["megatron"])
    (mc_lo, mc_hi), (t_lo, t_hi) = compat.SUPPORTED["megatron-core"], compat.SUPPORTED["torch"]
    assert f"megatron-core>={mc_lo[0]}.{mc_lo[1]},<{mc_hi[0]}.{mc_hi[1] + 1}" in extra
    # ("a0": NGC's torch 2.8.0a0+... is 2.8, and a plain >=2.8 would replace it with PyPI's)
    assert f"torch>={t_lo[0]}.{t_lo[1]}.0a0,<{t_hi[0]}.{t_hi[1] + 1}" in extra
    assert "pyyaml" in extra  # (megatron.training of megatron-core 0.17 and 0.18 imports it undeclared)


def test_ci_runs_the_oldest_and_newest_supported_releases():
    script = open(os.path.join(REPO, "scripts", "run_cpu_tests.sh")).read()
    cells = re.search(r'CI_CELLS=\$\{CI_CELLS:-"([^"]+)"\}', script).group(1).split()
    pairs = [(compat._release(t), compat._release(m)) for t, m in (cell.split(":") for cell in cells)]
    torch_minors = {t for t, _ in pairs}
    mcore_minors = {m for _, m in pairs}
    assert set(compat.SUPPORTED["torch"]) <= torch_minors
    assert set(compat.SUPPORTED["megatron-core"]) <= mcore_minors
    assert all(compat.version_problem({"torch": t, "megatron-core": m}) is None
               for t, m in (cell.split(":") for cell in cells))
