"""`nmt serve --engine ctranslate2 -m FOLDER` serves the same API with the same features: the server's
tests of tests/test_serve.py (requests, alternatives, HTML, forms, hostile input, CORS, metrics, limits,
fairness beside a 10,000-line request, SIGTERM during a long one), run again here against the reversal
model exported to CTranslate2."""

from __future__ import annotations

import pytest

pytest.importorskip("ctranslate2", reason="needs CTranslate2 (the dev extra): pip install 'nmt[ctranslate2]'")
pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")
pytest.importorskip("starlette", reason="nmt serve needs its extra: pip install 'nmt[serve]'")

# The server's tests once more, on the other engine: about 40 s, so in `make test`, not `make test-fast`
pytestmark = pytest.mark.slow

from typer.testing import CliRunner  # noqa: E402

from nmt.cli import app  # noqa: E402

# Collected here again, with this module's `server`: the same requests, the same expected answers.
from .test_serve import (  # noqa: E402, F401
    Server,
    test_a_full_queue_answers_503_and_a_late_request_504,
    test_a_malformed_request_among_good_ones_fails_alone,
    test_a_one_line_request_beside_a_10000_line_one_is_answered_within_a_few_seconds,
    test_a_page_on_another_origin_may_call_the_server,
    test_bad_requests_get_a_json_error_and_the_server_keeps_serving,
    test_http_edges_answer_in_json_with_the_right_status,
    test_libretranslate_fields_auto_alternatives_html_form_and_truncation,
    test_libretranslate_requests,
    test_metrics_in_prometheus_text,
    test_metrics_labels_are_a_fixed_set_whatever_the_requests,
    test_opennmt_requests,
    test_sigterm_during_a_long_request_answers_503_in_json_and_exits_0_in_time,
    test_the_page_shows_the_pair_and_settings,
    test_what_the_parsers_raise_is_the_clients_error_in_json,
)


@pytest.fixture(scope="module")
def served(synthetic_run, tmp_path_factory) -> list[str]:
    """The reversal model exported to CTranslate2, served by that engine."""
    folder = tmp_path_factory.mktemp("ct2") / "reversal-ct2"
    best = synthetic_run / "checkpoints" / "best.pt"
    exported = CliRunner().invoke(
        app, ["export", "-m", str(best), "--format", "ctranslate2", "-o", str(folder)]
    )
    assert exported.exit_code == 0, exported.output
    return [str(folder), "--engine", "ctranslate2"]


@pytest.fixture(scope="module")
def server(served):
    s = Server(*served, "--batch-wait-ms", "20", "--max-chars", "2000")
    assert "CTranslate2" in "".join(s.log)  # the start line says which engine answers
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def test_the_ctranslate2_server_refuses_what_it_cannot_do_in_one_line(synthetic_run, tmp_path):
    """Options the engine cannot honour stop the server before it listens, in one line."""
    import ctranslate2

    best = synthetic_run / "checkpoints" / "best.pt"
    folder = tmp_path / "ct2"
    assert CliRunner().invoke(app, ["export", "-m", str(best), "-o", str(folder)]).exit_code == 0
    cases = [(["-m", str(best)], "not a model folder written by `nmt export`")]
    supported = ctranslate2.get_supported_compute_types("cpu")
    missing = [d for d, c in (("fp16", "float16"), ("bf16", "bfloat16")) if c not in supported]
    if missing:  # what CTranslate2 cannot compute in on this CPU (both, on x86 CPUs so far)
        cases.append(
            (["-m", str(folder), "--dtype", missing[0]], f"--dtype {missing[0]}: CTranslate2 cannot")
        )
    for args, expected in cases:
        result = CliRunner().invoke(app, ["serve", "--engine", "ctranslate2", *args, "--device", "cpu"])
        assert result.exit_code == 2, result.output
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
