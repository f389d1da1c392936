"""rlpipe.render's colour scale: white is neutral, the sign picks the hue, the legend spans the shown values."""
from rlpipe.render import color_scale, legend_stops, token_color, visible


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
