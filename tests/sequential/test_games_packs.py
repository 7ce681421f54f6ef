"""The games presets' packing of SASRec's Video.txt (sequential/recipes.py): its token budget
holds SASRec's batch of 128 users in every pack of the run, so the run's step count is the
paper's 201 epochs of 243 batches."""

import dataclasses

import numpy as np

from sequential import recipes
from sequential.hstu.presets import games as hstu_games
from sequential.sasrec.presets import games as sasrec_games
from sequential.source import SequenceSource
from tests.data.sequences.video import video_path


def test_every_games_pack_holds_128_users_within_the_budget(tmp_path):
    cfg = sasrec_games()
    assert cfg.data.token_budget == recipes.GAMES_TOKEN_BUDGET
    assert hstu_games().data == cfg.data
    data = dataclasses.replace(cfg.data, sasrec_path=video_path(tmp_path))
    packer = SequenceSource(dataclasses.replace(cfg, data=data)).train_packer
    epochs = cfg.train.num_steps // recipes.GAMES_PACKS_PER_EPOCH
    assert epochs == 201
    users = packer.hist.num_users
    for epoch in range(epochs):
        _, cuts = packer.epoch_plan(epoch)
        # 242 packs of 128 users and the remainder (31,013 = 242 * 128 + 37).
        want = np.minimum(np.arange(recipes.GAMES_PACKS_PER_EPOCH + 1) * 128, users)
        np.testing.assert_array_equal(cuts, want, err_msg=f"epoch {epoch}")
