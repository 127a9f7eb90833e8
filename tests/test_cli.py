"""Command lines: --help shows defaults and variables; status commands; clean errors."""

import json

import pytest
from click.testing import CliRunner

from fakes import running_server
from starsd_draftd.cli import main as draftd
from starsd_target.cli import main as target


@pytest.mark.parametrize("cli, args, must", [
    (draftd, ["serve", "--help"], ["--bind", "default: tcp://127.0.0.1:5555", "STARSD_DRAFTD_BIND", "--batch-max",
                                   "--curve-allow", "--metrics-port", "--backend"]),
    (draftd, ["demo", "--help"], ["--targets", "STARSD_DRAFTD_TARGETS", "default: 2"]),
    (draftd, ["keygen", "--help"], ["--name"]),
    (target, ["generate", "--help"], ["--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                                      "--no-draft", "--json", "STARSD_TARGET_DRAFT_TIMEOUT", "default: 5"]),
    (target, ["serve", "--help"], ["--listen", "--http", "--max-active", "STARSD_TARGET_METRICS_PORT"]),
])
def test_help_shows_defaults_and_environment(cli, args, must):
    out = CliRunner().invoke(cli, args, terminal_width=200)
    assert out.exit_code == 0, out.output
    for text in must:
        assert text in out.output, text


def test_draftd_status_reads_a_running_daemon():
    with running_server() as (server, ctx):
        out = CliRunner().invoke(draftd, ["status", "--connect", server.endpoint, "--json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.output)["live_sessions"] == 0
        out = CliRunner().invoke(draftd, ["status", "--connect", server.endpoint])
        assert "live sessions 0" in out.output


def test_status_of_nothing_fails_cleanly():
    out = CliRunner().invoke(target, ["status", "--connect", "tcp://127.0.0.1:9", "--timeout", "0.2"])
    assert out.exit_code == 1 and "no reply" in out.output


def test_bad_model_directory_is_a_clear_error(tmp_path):
    out = CliRunner().invoke(target, ["generate", "--model", str(tmp_path), "--prompt", "x", "--no-draft"])
    assert out.exit_code == 1 and "not a model directory" in out.output
