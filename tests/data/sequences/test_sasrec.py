"""SASRec's ``user item`` files (data/sequences/sasrec.py).

The real ``data/Video.txt`` is read in place from a snapshot of github:kang205/SASRec (a bare
git directory, ``RECSCALE_SASREC_REPO``, default ``/work/.mirror/kang205+SASRec/repo``) or from
a plain file named by ``RECSCALE_SASREC_VIDEO`` (``tests/data/sequences/video.py``); the test
skips when neither is there. The data is never copied into the project.
"""

from collections import defaultdict

import numpy as np
import pytest

from data.sequences import sasrec
from data.sequences.sasrec import SasrecFormatError, data_partition, read_sasrec, sasrec_stats
from tests.data.sequences.video import video_txt


def reference_partition(lines: list[str]) -> list:
    """SASRec's ``util.data_partition`` (the repository's algorithm) over the lines."""
    usernum = itemnum = 0
    user = defaultdict(list)
    for line in lines:
        u, i = line.rstrip().split(" ")
        u, i = int(u), int(i)
        usernum, itemnum = max(u, usernum), max(i, itemnum)
        user[u].append(i)
    train, valid, test = {}, {}, {}
    for u, seq in user.items():
        if len(seq) < 3:
            train[u], valid[u], test[u] = seq, [], []
        else:
            train[u], valid[u], test[u] = seq[:-2], [seq[-2]], [seq[-1]]
    return [train, valid, test, usernum, itemnum]


def test_partition_of_a_crafted_file(tmp_path):
    lines = ["1 5", "1 3", "1 5", "1 9", "2 4", "2 1", "3 2", "3 8", "3 6 ", "5 7"]
    path = tmp_path / "tiny.txt"
    path.write_text("\n".join(lines) + "\n")
    hist = read_sasrec(path)
    ours = data_partition(hist)
    assert ours == reference_partition(lines)
    assert ours[0] == {1: [5, 3], 2: [4, 1], 3: [2], 5: [7]}
    assert ours[1] == {1: [5], 2: [], 3: [8], 5: []}
    assert ours[2] == {1: [9], 2: [], 3: [6], 5: []}
    assert ours[3:] == [5, 9]
    assert hist.user_items(0).tolist() == [5, 3, 5, 9]  # item ids are the file's
    stats = sasrec_stats(hist)
    assert (stats.users, stats.items, stats.actions, stats.users_short) == (4, 9, 10, 2)


@pytest.mark.parametrize(
    "text, line, message",
    [
        ("1 2\n1 x\n", 2, "field 'x' is not a non-negative integer"),
        ("1 2\n1 2.5\n", 2, "field '2.5' is not"),
        ("1 2\n1 2 3\n", 2, "expected 2 fields 'user item', got 3"),
        ("1 2\n2\n", 2, "expected 2 fields 'user item', got 1"),
        ("1 2\n\n2 3\n", 2, "blank line"),
        ("1 2\n2\t3\n", 2, "separated by one space"),
        ("1 2\n1 3\n2 1\n2 2\n1 4\n", 5, "user 1 reappears after other users (their lines ended"),
        ("1 2\n0 3\n", 2, "user id 0; ids are 1-based"),
        ("1 2\n1 0\n", 2, "item id 0; ids are 1-based"),
    ],
)
def test_bad_files_name_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(SasrecFormatError) as err:
        read_sasrec(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: line {line}: "), msg
    assert message in msg and "\n" not in msg


def test_out_of_order_history_names_both_lines(tmp_path):
    path = tmp_path / "split_user.txt"
    path.write_text("1 2\n1 3\n2 1\n1 4\n")
    with pytest.raises(SasrecFormatError, match=r"line 4: user 1 .* ended at line 2"):
        read_sasrec(path)


def test_bytes_source_is_named():
    with pytest.raises(SasrecFormatError, match=r"^mem.txt: line 1: "):
        read_sasrec(b"a b\n", name="mem.txt")
    hist = read_sasrec(b"3 1\n3 2")  # no final newline
    assert hist.user_items(0).tolist() == [1, 2]


def test_video_txt_statistics_match_the_paper():
    data, name = video_txt()
    hist = read_sasrec(data, name=name)
    stats = sasrec_stats(hist)
    # Measured on the snapshot; the paper's Table II (sasrec.PAPER_GAMES) rounds them.
    assert (stats.users, stats.items, stats.actions) == (31013, 23715, 287107)
    assert (stats.usernum, stats.itemnum, stats.users_short) == (31013, 23715, 112)
    paper = sasrec.PAPER_GAMES
    assert stats.users == paper["users"] and stats.items == paper["items"]
    assert round(stats.avg_actions_per_user, 1) == paper["avg_actions_per_user"]  # 9.258
    assert round(stats.avg_actions_per_item, 1) == paper["avg_actions_per_item"]  # 12.107
    assert round(stats.actions, -5) == paper["actions"]
    # The leave-one-out partition is SASRec's own.
    ours = data_partition(hist)
    assert ours == reference_partition(data.decode().splitlines())
    assert sum(map(len, ours[0].values())) == 287107 - 2 * (31013 - 112)
    assert np.all(hist.lengths() >= 1)
