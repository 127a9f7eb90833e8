"""What `make edge-check` relies on, checked without emulation: a target-only install
(`pip install '.[target]'`) asks for none of the packages the check refuses to find on a board,
and the check's own command line parses. The emulated run itself (an arm64 root, torch under
qemu) takes tens of minutes and root: a documented manual step, its figures in docs/deploy.md."""

import configparser
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _requirements(section: str, key: str) -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [ln.split("#")[0].strip() for ln in cfg[section][key].splitlines()]
    return {re.split(r"[<>=!~\[ ;]", ln)[0].lower() for ln in lines if ln}


def test_a_target_only_install_brings_nothing_the_edge_check_refuses():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import edge_check
    finally:
        sys.path.pop(0)
    wanted = _requirements("options", "install_requires") | _requirements("options.extras_require", "target")
    assert wanted, "no requirements read"
    assert not wanted & {p.lower() for p in edge_check.DRAFT_SIDE}, wanted & set(edge_check.DRAFT_SIDE)
    # the draft side's own extras do bring some of them: the list names real draft-side packages
    draft_side = _requirements("options.extras_require", "eagle") | _requirements("options.extras_require", "demo") \
        | _requirements("options.extras_require", "test")
    assert draft_side & set(edge_check.DRAFT_SIDE)


def test_the_edge_check_explains_itself():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "edge_check.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--root" in r.stdout and "emulation" in r.stdout
