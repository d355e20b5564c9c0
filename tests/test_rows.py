"""distributed/rows.py: the int32 rows ranks exchange (the ring tests gather them across ranks:
tests/startup/test_handshake.py)."""

import mlx.core as mx

from distributed.rows import HOST_CHARS, columns_text, gather_rows, join_int, split_int, text_columns


def test_a_byte_count_past_int32_survives_two_columns():
    for value in (0, 1, 2**31 - 1, 2**31, 5 * 2**40 + 12345, 2**62 - 1):
        high, low = split_int(value)
        assert 0 <= high < 2**31 and 0 <= low < 2**31
        assert join_int(high, low) == value


def test_text_is_cut_to_its_width_and_padded():
    assert columns_text(text_columns("mac-studio.local")) == "mac-studio.local"
    long = "h" * (HOST_CHARS + 10)
    assert len(text_columns(long)) == HOST_CHARS
    assert columns_text(text_columns(long)) == "h" * HOST_CHARS


def test_one_rank_gathers_its_own_row():
    group = mx.distributed.init()  # a process started alone: a group of one
    row = split_int(3 * 2**33) + text_columns("alone")
    [back] = gather_rows(group, row)
    assert back == row
