"""Stop strings across token boundaries: hand-worked expectations, and long random streams
against a reference that searches the whole text each time."""

from __future__ import annotations

from gateway.stop import StopStringMatcher


def stream(stop: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    matcher = StopStringMatcher(stop)
    released = [matcher.add(p) for p in pieces]
    tail = "" if matcher.stopped else matcher.flush()
    return released, matcher.stopped, "".join(released) + tail


def test_a_stop_string_split_over_three_pieces_is_found_and_not_released() -> None:
    released, stopped, text = stream(["END"], ["Hello E", "N", "D and more"])
    assert stopped
    assert text == "Hello "
    # "E" was held back until "N" and "D" decided it.
    assert released == ["Hello ", "", ""]


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    released, stopped, text = stream(["END"], ["Hello E", "N", "x"])
    assert not stopped
    assert released == ["Hello ", "", "ENx"]
    assert text == "Hello ENx"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    _, stopped, text = stream(["world", "lo w"], ["hel", "lo wor", "ld"])
    assert stopped and text == "hel"


def test_text_after_the_stop_string_in_the_same_piece_is_dropped() -> None:
    _released, stopped, text = stream(["\n\n"], ["line one\n", "\nline two"])
    assert stopped and text == "line one"


def test_without_stop_strings_everything_is_released_at_once() -> None:
    released, stopped, _text = stream([], ["a", "b"])
    assert released == ["a", "b"] and not stopped


def test_held_text_is_flushed_at_the_end() -> None:
    released, stopped, text = stream(["STOP"], ["the end ST"])
    assert released == ["the end "] and text == "the end ST" and not stopped


def test_a_stop_string_at_the_very_start() -> None:
    _, stopped, text = stream(["<"], ["<tag>"])
    assert stopped and text == ""


def reference(stop: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    """The matcher's contract on the whole text each time: release up to the earliest stop
    string, else all but the longest suffix that begins one."""
    text, released, out = "", 0, []
    for piece in pieces:
        text += piece
        found = [p for p in (text.find(s) for s in stop) if p >= 0]
        if found:
            out.append(text[released:min(found)])
            return out + [""] * (len(pieces) - len(out)), True, text[:min(found)]
        held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])),
                   default=0)
        end = max(released, len(text) - held)
        out.append(text[released:end])
        released = end
    return out, False, text


def test_long_random_streams_match_the_whole_text_reference_and_keep_little() -> None:
    import random

    rng = random.Random(3)
    stopped = 0
    for case in range(3000):
        stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                for _ in range(rng.randint(1, 3))]
        pieces = ["".join(rng.choice("abcd") for _ in range(rng.randint(0, 4)))
                  for _ in range(rng.randint(1, 200))]
        matcher = StopStringMatcher(stop)
        released, kept = [], 0
        for piece in pieces:
            released.append(matcher.add(piece))
            kept = max(kept, len(matcher._text))  # what it holds on to
        assert released == reference(stop, pieces)[0], case
        # Bounded by the longest stop string and a piece, not by the output's length.
        assert kept <= 2 * max(map(len, stop)) + 4, (case, kept)
        stopped += matcher.stopped
    assert stopped > 300 and case + 1 - stopped > 100, stopped  # both endings reached
