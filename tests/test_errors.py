"""The one error helper (`pipeline.common.messages`): `brief` formats an error for a user, `best_effort` warns
and goes on."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from pipeline.common.errors import Interruption
from pipeline.common.messages import best_effort, brief

SRC = Path(__file__).resolve().parents[1] / "src"


def test_brief_gives_the_type_and_the_message_on_one_masked_line() -> None:
    err = OSError("cannot reach postgresql://ann:hunter2@db:5432/runs\n   retry   later")
    assert brief(err) == "OSError: cannot reach postgresql://ann:***@db:5432/runs retry later"


def test_brief_masks_the_runs_own_secret_values_and_cuts_long_messages() -> None:
    err = RuntimeError("token s3cr3t-value refused " + "x" * 500)
    text = brief(err, secrets={"s3cr3t-value"}, limit=40)
    assert text == "RuntimeError: token *** refused " + "x" * (40 - len("token *** refused "))


def test_brief_keeps_the_first_line_only_when_asked() -> None:
    assert brief(ValueError("width must be > 0\nTraceback ..."), first_line=True) == "ValueError: width must be > 0"


def test_an_error_without_a_message_is_its_type_with_or_without_the_type_asked_for() -> None:
    assert brief(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert brief(ValueError("  "), with_type=False) == "ValueError"
    assert brief(ValueError("bad value"), with_type=False) == "bad value"


def test_brief_says_where_after_the_type() -> None:
    assert brief(KeyError("x"), where=" at loop.py:88") == "KeyError at loop.py:88: 'x'"


def test_best_effort_logs_what_failed_with_the_brief_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("pipeline.test")
    with caplog.at_level(logging.WARNING, logger="pipeline.test"), best_effort("the summary was not kept", log) as one:
        raise OSError("disk full, password=abc")
    assert one.failed and one.error == "OSError: disk full, password=***"
    assert caplog.messages == ["the summary was not kept (OSError: disk full, password=***)"]


def test_best_effort_that_succeeds_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG), best_effort("nothing fails", logging.getLogger("pipeline.test")) as one:
        pass
    assert not one.failed and one.error is None and caplog.messages == []


@pytest.mark.parametrize("stop", [Interruption("SIGTERM"), KeyboardInterrupt(), SystemExit(3)])
def test_best_effort_never_swallows_a_stop(stop: BaseException) -> None:
    with pytest.raises(type(stop)), best_effort("a stop passes through", logging.getLogger("pipeline.test")):
        raise stop


def test_no_module_formats_an_errors_type_by_hand() -> None:
    """``brief`` is the one place an exception's type becomes text (issue 28: 41 hand-made copies)."""
    by_hand = re.compile(r"type\((err|exc|error|e|stop|failure)\)\.__name__")
    found = [
        f"{path.relative_to(SRC)}:{number}"
        for path in SRC.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if by_hand.search(line) and path.name != "messages.py"
    ]
    assert found == []
