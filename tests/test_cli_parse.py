from __future__ import annotations

import pytest

from agent.cli.admin import CliError, parse_ops
from agent.wire import ops_from_pb
from controlplane.ops import Consolidate, Migrate, Replicate


def test_parse_ops_round_trip() -> None:
    ops = ops_from_pb(parse_ops(["replicate", "3", "17", "5", ";", "migrate", "0", "4", "1", "2;",
                                 "consolidate", "2", "7,9", "4"]))
    assert ops == (Replicate(3, 17, 5), Migrate(0, 4, 1, 2), Consolidate(2, (7, 9), 4))


@pytest.mark.parametrize(("words", "needle"), [
    (["explode", "1"], "'explode'"),
    (["replicate", "1", "2"], "takes 3 arguments"),
    (["migrate", "a", "b", "c", "d"], "must be integers"),
    ([";"], "no operation"),
])
def test_parse_ops_errors(words: list[str], needle: str) -> None:
    with pytest.raises(CliError, match=needle):
        parse_ops(words)
