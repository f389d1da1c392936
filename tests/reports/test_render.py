"""rlpipe.reports.render's colour scale: white is neutral, the sign picks the hue, the legend spans the shown values."""
from rlpipe.reports.render import (Line, color_scale, diff_numbers, fmt, legend_range_note, legend_stops, percentile, summary_lines,
                           token_cells, token_color, visible)


def records(column, *rows):
    return [{"per_token": {column: list(r)}} for r in rows]


def test_diverging_scale_is_symmetric_around_zero():
    scale = color_scale(records("token_advantages", [-0.5, 2.0], [1.0]), "token_advantages")
    assert (scale["lo"], scale["hi"]) == (-2.0, 2.0)
    assert token_color(0.0, scale) == "#ffffff"
    pos, neg = token_color(2.0, scale), token_color(-2.0, scale)
    assert pos != neg and int(pos[5:7], 16) > int(pos[1:3], 16)  # blue side
    assert int(neg[1:3], 16) > int(neg[5:7], 16)  # red side
    assert [v for v, _ in legend_stops(scale)] == [-2.0, -1.0, 0.0, 1.0, 2.0]


def test_logprob_scale_marks_unlikely_tokens_and_handles_empty_rows():
    scale = color_scale(records("sampler_logprobs", [-4.0, -0.1]), "sampler_logprobs")
    assert (scale["lo"], scale["hi"]) == (-4.0, 0.0)
    assert token_color(0.0, scale) == "#ffffff" and token_color(-4.0, scale) != "#ffffff"
    assert color_scale(records("entropy", []), "entropy")["hi"] == 1.0
    assert color_scale([], None) is None
    assert token_color(None, scale) == "#ffffff"
    assert visible("a\nb\t") == "a⏎b⇥" and visible("") == "·"


def test_scale_ends_at_the_99th_percentile_not_at_an_outlier():
    """99 tokens at |0.1| and one at 7.75: nearest rank ceil(0.99 * 100) = 99 -> 0.1, not 7.75."""
    values = [0.1, -0.1] * 49 + [0.1, 7.75]
    scale = color_scale(records("log_ratio", values), "log_ratio")
    assert (scale["lo"], scale["hi"]) == (-0.1, 0.1)
    assert (scale["tokens"], scale["clipped"], scale["extreme"]) == (100, 1, 7.75)
    assert token_color(7.75, scale) == token_color(0.1, scale) != "#ffffff"  # the outlier: full colour
    assert legend_range_note(scale) == ("range ±0.100: the 99th percentile of |value| over the 100 shown tokens; "
                                        "1 token(s) beyond it at full colour (extreme 7.750)")
    lp = color_scale(records("sampler_logprobs", [-0.5] * 99 + [-30.0]), "sampler_logprobs")
    assert (lp["lo"], lp["clipped"]) == (-0.5, 1)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([5.0], 99) == 5.0


def test_numbers_never_print_negative_zero_and_diff_numbers_share_decimals():
    assert fmt(-0.0) == "0.000" and fmt(0.0) == "0.000" and fmt(-0.25) == "-0.250"
    assert diff_numbers({"a": 0.5, "b": 0.75, "delta": 0.25}) == ("0.5000", "0.7500", "+0.2500")
    assert diff_numbers({"a": 75.5, "b": 160.25, "delta": 84.75}) == ("75.50", "160.25", "+84.75")
    assert diff_numbers({"a": 3, "b": 4, "delta": 1}) == ("3", "4", "+1")
    assert diff_numbers({"a": 0.1, "b": 0.10001, "delta": 1e-5}) == ("0.1000", "0.1000", "+1e-05")
    assert diff_numbers({"a": None, "b": 0.5, "delta": None}) == ("-", "0.5000", "-")
    assert diff_numbers({"a": -2e-9, "b": 0.25, "delta": 0.25})[0] == "0.0000"  # not "-0.0000"
    assert diff_numbers({"a": 0.0, "b": 0.25, "delta": 0.25})[0] == "0.0000"  # not ".0000"
    assert diff_numbers({"a": 0, "b": 0.5, "delta": 0.5})[0] == "0.0000"


def test_summary_lines_nest_components_and_split_histograms():
    summary = {"rows_selected": 8, "rows_total": 8, "reward": {"mean": 1.0, "std": 0.5, "min": 0.0, "max": 1.5},
               "components": {"exact": {"mean": 0.5, "std": 0.5, "min": 0.0, "max": 1.0}},
               "groups": {"count": 4, "size_mean": 2.0, "singletons": 0, "zero_variance_share": 0.25,
                          "group_mean": None, "within_group_std_mean": 0.3,
                          "correct_per_group": [{"correct": 0, "of": 2, "groups": 1},
                                                {"correct": 1, "of": 2, "groups": 3}]}}
    lines = summary_lines(summary)
    assert Line("reward_exact", "0.500 ± 0.500  [0.000, 1.000]", 1) in lines
    assert Line("0/2 correct", "1 group(s)", 2, 1 / 3) in lines and Line("1/2 correct", "3 group(s)", 2, 1.0) in lines


def test_token_cells_carry_every_value_and_one_colour():
    rec = {"tokens": ["a", "\n"], "token_ids": [7, 8], "per_token": {"token_advantages": [1.0, -1.0],
                                                                     "entropy": [0.25, 0.5]}}
    scale = color_scale([rec], "token_advantages")
    cells = token_cells(rec, "token_advantages", scale)
    assert [(c.text, c.token_id) for c in cells] == [("a", 7), ("⏎", 8)]
    assert cells[0].colour == token_color(1.0, scale) and cells[1].colour == token_color(-1.0, scale)
    assert cells[1].tooltip() == "token 1: '⏎' (id 8)\ntoken_advantages = -1\nentropy = 0.5"
    assert [c.colour for c in token_cells(rec, None, None)] == [None, None]


def test_judge_uses_each_metrics_direction():
    from rlpipe.reports.diff import HEADLINES, HIGHER, LOWER, judge

    assert judge(0.1, HIGHER) == "better" and judge(-0.1, HIGHER) == "worse"
    assert judge(0.1, LOWER) == "worse" and judge(-0.1, LOWER) == "better"
    assert judge(0.0, HIGHER) == "same" and judge(0.1, None) is None and judge(None, HIGHER) is None
    directions = {label: d for label, _, _, d in HEADLINES}
    assert directions["eval accuracy"] == HIGHER and directions["eval truncation rate"] == LOWER
    assert directions["KL to reference (trainer, kl_ref)"] is None  # a rise is learning or drift: not judged


def test_token_cells_mark_the_environments_tokens_and_the_turn_boundaries():
    """A rollout "ab" (turn 1, calls a tool) + "xy" (the environment's reply) + "c" (turn 2): the reply's
    cells get the observation colour whatever the column says, a separator before them, turn 2 a start."""
    from rlpipe.reports.render import OBSERVATION
    from rlpipe.reports.turn_view import turn_records

    call = {"turn": 0, "name": "add", "arguments": "1,2", "status": "timeout", "result": ""}
    row = {"policy_mask": [True, True, False, False, True], "turn_starts": [0, 4], "tool_calls": [call]}
    rec = {"tokens": list("abxyc"), "token_ids": [1, 2, 3, 4, 5], "turns": turn_records(row),
           "per_token": {"sampler_logprobs": [-2.0, 0.0, None, None, -1.0]}}
    scale = color_scale([rec], "sampler_logprobs")
    cells = token_cells(rec, "sampler_logprobs", scale)
    assert [c.observation for c in cells] == [False, False, True, True, False]
    assert [c.colour for c in cells][2:4] == [OBSERVATION] * 2 and cells[1].colour == "#ffffff"  # certain, not grey
    separator = "▸ turn 1 → tool call add(1,2) → timeout · the environment's reply follows (not the policy's tokens)"
    assert [c.turn_break for c in cells] == [None, None, separator, None, None]
    assert [c.turn_start for c in cells] == [None, None, None, None, 2]
    assert "the environment's token" in cells[2].tooltip() and "the environment's" not in cells[0].tooltip()
    single = token_cells({"tokens": ["a"], "turns": [], "per_token": {}}, None, None)[0]
    assert (single.observation, single.turn_break, single.turn_start, single.colour) == (False, None, None, None)
