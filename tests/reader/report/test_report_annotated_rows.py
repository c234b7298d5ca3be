"""A batch row as annotated pieces (reader/report/annotated_rows.py): the one decoding of rows that the report page and
``batches --show`` share."""

import numpy as np

from reader.report import annotated_rows

WORDS = {1: "The", 2: " cat", 3: ".", 4: "A", 5: " dog", 6: " ran", 7: "<b>&", 8: "\x1b[31mred"}


def decode(ids):
    return "".join(WORDS[i] for i in ids)


def test_a_packed_row_cut_at_document_starts():
    # a row that starts inside a document (position 3), then two whole documents
    p = annotated_rows.row_pieces(targets=[2, 3, 4, 5, 6, 1, 2], segment_ids=[1, 1, 2, 2, 2, 3, 3],
                        positions=[3, 4, 0, 1, 2, 0, 1], loss_mask=[True] * 7, decode=decode)
    assert [(x.kind, x.segment, x.start, x.ids, x.starts_document, x.text) for x in p] == [
        ("text", 1, 0, (2, 3), False, " cat."),
        ("text", 2, 2, (4, 5, 6), True, "A dog ran"),
        ("text", 3, 5, (1, 2), True, "The cat")]
    assert annotated_rows.terminal_row(p) == "… cat.|A dog ran|The cat"


def test_padding_is_marked_and_never_decoded():
    p = annotated_rows.row_pieces([1, 2, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 0, 0, 0], [True, True, False, False, False],
                        decode=decode)
    assert [(x.kind, x.ids, x.text) for x in p] == [("text", (1, 2), "The cat"), ("pad", (0, 0, 0), "")]
    assert annotated_rows.terminal_row(p) == "The cat···"
    long_pad = annotated_rows.row_pieces([1] + [0] * 20, [1] + [0] * 20, [0] * 21, [True] + [False] * 20, decode=decode)
    assert annotated_rows.terminal_row(long_pad) == "The···(20 padding)···"


def test_masked_tokens_are_their_own_pieces_in_brackets():
    # a supervised row: the prompt (masked out of the loss) and the completion of one document, then padding
    p = annotated_rows.row_pieces([4, 5, 6, 3, 0], [1, 1, 1, 1, 0], [0, 1, 2, 3, 0], [False, False, True, True, False],
                        decode=decode)
    assert [(x.kind, x.text, x.starts_document) for x in p] == [("masked", "A dog", True), ("text", " ran.", False),
                                                                 ("pad", "", False)]
    assert annotated_rows.terminal_row(p) == "[A dog] ran.·"
    coloured = annotated_rows.terminal_row(p, colour=True)
    assert "\x1b[36;2mA dog\x1b[0m" in coloured and "\x1b[36m ran.\x1b[0m" in coloured  # dim, same colour
    html = annotated_rows.html_row(p)
    assert 'class="seg0 masked"' in html and "masked out of the loss" in html and 'class="pad"' in html


def test_an_unpacked_rows_later_piece_says_it_continues():
    p = annotated_rows.row_pieces([5, 6], [1, 1], [40, 41], [True, True], decode=decode)
    assert annotated_rows.terminal_row(p) == "… dog ran"


def test_text_is_escaped_for_the_terminal_and_the_page():
    p = annotated_rows.row_pieces([7, 8], [1, 2], [0, 0], [True, True], decode=decode)
    assert annotated_rows.terminal_row(p) == "<b>&|\\x1b[31mred"  # no escape sequence from the data reaches the terminal
    html = annotated_rows.html_row(p)
    assert "&lt;b&gt;&amp;" in html and "<b>" not in html and "\x1b" not in html
    assert html.count('class="doc"') == 1  # one document start after the first


def test_batch_rows_and_ids_when_nothing_decodes():
    batch = {"targets": np.array([[1, 2], [99, 3]]), "segment_ids": np.array([[1, 1], [1, 1]]),
             "positions": np.array([[0, 1], [0, 1]]), "loss_mask": np.ones((2, 2), bool)}
    shown = annotated_rows.ids_decoder(decode)
    assert annotated_rows.terminal_row(annotated_rows.batch_row_pieces(batch, 0, shown)) == "The cat"
    assert annotated_rows.terminal_row(annotated_rows.batch_row_pieces(batch, 1, shown)) == "<99 3>"  # 99: not the tokenizer's
    assert annotated_rows.terminal_row(annotated_rows.batch_row_pieces(batch, 0, annotated_rows.ids_decoder(None))) == "<1 2>"
    assert annotated_rows.row_pieces([], [], [], [], decode) == []
