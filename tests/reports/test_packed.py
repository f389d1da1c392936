"""rlpipe.reports.packed: an inspect page's tokens stored once, round-tripped exactly (or to the stated precision)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rlpipe.reports import html
from rlpipe.reports.packed import LOG8_LEVELS, log8, pack, token_arrays, unlog8, unpack

RECORDS = [
    {"tokens": ["a", "\n", "é", ""], "token_ids": [5, 6, None, 8],
     "per_token": {"sampler_logprobs": [-0.5, None, -7.25, 0.0]}},
    {"tokens": ["😀", " x"], "token_ids": [9, 10], "per_token": {"sampler_logprobs": [-1e-9, -20.0]}},
]


def _page(packed) -> str:
    return f"<html>{packed.script_tag()}</html>"


def test_tokens_round_trip_with_offsets_text_ids_and_float32_values():
    arrays = token_arrays(RECORDS, ["sampler_logprobs"])
    got = unpack(_page(pack(arrays, ["sampler_logprobs"], dtype="f4")))
    assert got["offsets"] == [0, 4, 6]
    # visible text: a newline drawn as ⏎, an empty piece as ·; an emoji is 2 UTF-16 units but one piece
    assert got["pieces"] == ["a", "⏎", "é", "·", "😀", " x"]
    assert got["ids"].tolist() == [5, 6, -1, 8, 9, 10]
    values = got["values"]["sampler_logprobs"]
    assert values[[0, 2, 3, 5]].tolist() == [-0.5, -7.25, 0.0, -20.0] and math.isnan(values[1])
    assert values[4] == np.float32(-1e-9)


def test_float16_and_log8_keep_their_stated_precision():
    arrays = token_arrays(RECORDS, ["sampler_logprobs"])
    half = unpack(_page(pack(arrays, ["sampler_logprobs"], dtype="f2")))["values"]["sampler_logprobs"]
    assert half[[0, 2, 5]].tolist() == [-0.5, -7.25, -20.0] and half[4] == pytest.approx(-1e-9, abs=6e-8)
    byte = unpack(_page(pack(arrays, ["sampler_logprobs"], dtype="q8", with_ids=False)))
    assert byte["ids"] is None
    q = byte["values"]["sampler_logprobs"]
    # magnitudes 1e-9 .. 20 span 34 octaves: the kept range is the top 24 (down to 20 / 2**24), 1e-9 becomes 0
    assert q[4] == 0.0 and q[3] == 0.0 and math.isnan(q[1])
    step = 24 / (LOG8_LEVELS - 1)
    for i, exact in ((0, -0.5), (2, -7.25), (5, -20.0)):
        assert abs(math.log2(-q[i]) - math.log2(-exact)) <= step / 2 + 1e-12, (i, q[i])


def test_log8_codes_by_hand():
    # magnitudes 1 and 4: log2 0 and 2, 126 steps of 2/126; zero, no value and infinities keep their meaning
    codes, scale = log8(np.array([1.0, -4.0, 2.0, 0.0, np.nan, np.inf, -np.inf]))
    assert scale == [0.0, 2 / 126]
    assert codes.tolist() == [1, 128 + 126, 1 + 63, 0, 255, 127, 254]
    assert unlog8(codes, scale)[:4].tolist() == [1.0, -4.0, 2.0, 0.0]


def test_the_same_rows_give_the_same_page_bytes():
    arrays = token_arrays(RECORDS, ["sampler_logprobs"])
    one = pack(arrays, ["sampler_logprobs"], dtype="q8").script_tag()
    assert one == pack(token_arrays(RECORDS, ["sampler_logprobs"]), ["sampler_logprobs"], dtype="q8").script_tag()


def test_a_script_end_tag_in_a_token_cannot_close_the_data_early():
    records = [{"tokens": ["</script>", "<b>"], "token_ids": [1, 2], "per_token": {}}]
    tag = pack(token_arrays(records, []), [], dtype="f4").script_tag()
    assert tag.count("</script>") == 1
    assert unpack(f"<html>{tag}</html>")["pieces"] == ["</script>", "<b>"]


def test_unpack_names_what_is_missing():
    with pytest.raises(ValueError, match="rlpipe-tokens"):
        unpack("<html></html>")


def test_budget_steps_float16_then_one_byte_then_columns_then_rows():
    rng = np.random.default_rng(1)
    rows = [{"prompt_id": k, "sample_idx": 0, "tokens": ["tok"] * 500, "token_ids": list(range(500)),
             "per_token": {c: rng.normal(size=500).tolist() for c in ("token_advantages", "sampler_logprobs",
                                                                     "entropy")}} for k in range(20)]
    data = {"rows": rows, "color_by": "token_advantages", "groups": {}}
    _, kept, notes = html.fit_tokens(data, 10_000_000)
    assert (kept, notes) == (20, [])  # float32, everything
    _, kept, notes = html.fit_tokens(data, 90_000)  # float32: 147 kB, float16: 79 kB
    assert kept == 20 and notes == [html.PRECISION_NOTES["f2"]]
    packed, kept, notes = html.fit_tokens(data, 30_000)  # one byte a value: ~11 kB a column, 0.8 kB the ids
    assert kept == 20 and notes[0] == html.PRECISION_NOTES["q8"]
    assert packed.columns == ("token_advantages", "sampler_logprobs") and packed.left_out == ("entropy",)
    assert "left out of the page to keep it under 30 kB: entropy; `rlpipe view` shows every column" in notes[1]
    assert unpack(f"<html>{packed.script_tag()}</html>")["ids"] is not None  # cheap: kept after entropy failed
    packed, kept, notes = html.fit_tokens(data, 10_000)
    assert 1 <= kept < 20 and f"the page holds the first {kept} of the 20 rows asked for" in notes[-1]
    assert packed.size + sum(len(s.encode()) for s in html.row_skeletons(data, kept)) <= 10_000


def test_multi_turn_rows_carry_their_environment_tokens_and_turn_lines_once():
    """Two rollouts "ab" (turn 1, calls a tool) + "xy" (the environment's reply) + "c" (turn 2), and a
    single-turn row between them: the reply's tokens are flagged, the separator before "x" and the turn-2
    line before "c" are label indices, and the two rows' identical lines are stored once."""
    from rlpipe.reports.turn_view import turn_records

    call = {"turn": 0, "name": "add", "arguments": "1,2", "status": "timeout", "result": ""}
    turns = turn_records({"policy_mask": [True, True, False, False, True], "turn_starts": [0, 4],
                          "tool_calls": [call]})
    multi = {"tokens": list("abxyc"), "token_ids": [1, 2, 3, 4, 5], "turns": turns, "per_token": {}}
    single = {"tokens": ["z"], "token_ids": [6], "turns": [], "per_token": {}}
    got = unpack(_page(pack(token_arrays([multi, single, multi], []), [], dtype="f4")))
    assert got["environment"].tolist() == [0, 0, 1, 1, 0] + [0] + [0, 0, 1, 1, 0]
    assert got["turns"] == {
        "labels": [("▸ turn 1 → tool call add(1,2) → timeout · the environment's reply follows (not the "
                    "policy's tokens)"), "turn 2 (the policy's tokens)"],
        "marks": [[[2, 0, -1], [4, -1, 1]], [], [[2, 0, -1], [4, -1, 1]]]}
    plain = unpack(_page(pack(token_arrays([single], []), [], dtype="f4")))
    assert plain["environment"] is None and plain["turns"] is None  # single-turn pages carry neither
