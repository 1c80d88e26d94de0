"""The request report: carried in a JSON answer's header or as a stream's comment line, and taken out
of the stream whole (or left alone when it is not whole)."""

import itertools

from pdserve.api.report import REPORT_COMMENT, TOKEN_BUCKETS, Report, comment, from_header, header_value, take_comment


def test_a_report_goes_through_a_header_and_a_stream_comment():
    report = Report(prompt_tokens=120, completion_tokens=8, ttft_s=0.25, tpot_s=0.01)
    assert from_header(header_value(report)) == report
    assert from_header(None) is None and from_header("not json") is None
    stream = b'data: {"x": 1}\n\n' + comment(report) + b'data: {"usage": {}}\n\ndata: [DONE]\n\n'
    rest, found = take_comment(stream)
    assert found == report
    assert rest == b'data: {"x": 1}\n\ndata: {"usage": {}}\n\ndata: [DONE]\n\n'


def test_a_chunk_without_a_whole_report_is_passed_on_untouched():
    assert take_comment(b"data: [DONE]\n\n") == (b"data: [DONE]\n\n", None)
    cut = comment(Report(1, 2))[:-5]
    assert take_comment(cut) == (cut, None)
    garbled = REPORT_COMMENT + b"{not json}\n\n"
    assert take_comment(garbled) == (garbled, None)


def test_one_choice_reports_its_times_and_the_buckets_are_fine_enough():
    assert Report(3, 4).ttft_s is None
    ratios = [upper / lower for lower, upper in itertools.pairwise(TOKEN_BUCKETS[1:])]
    assert TOKEN_BUCKETS[0] == 1 and TOKEN_BUCKETS[-1] == 1e6 and max(ratios) <= 1.5
