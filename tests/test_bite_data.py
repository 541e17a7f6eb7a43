"""data.seed as the run reads it: through the config (`build_split`), where tests/test_data.py
checks the seed of `PackedSamples` called directly."""
from __future__ import annotations

from pretrain.config import DataConfig
from pretrain.data import PackedSamples, build_split
from tests.test_data_blend import two_datasets  # noqa: F401  (the fixture)


def test_the_configs_seed_orders_the_split_and_its_samples(two_datasets):  # noqa: F811
    def split(seed: int) -> PackedSamples:
        return build_split(DataConfig(dataset=two_datasets[0], valid_fraction=0.05, seed=seed),
                           split="train", seq_length=16)

    seven, eight = split(7), split(8)
    direct = PackedSamples(two_datasets[0], seq_length=16, split="train", valid_fraction=0.05,
                           seed=7)
    assert seven.documents.tolist() == direct.documents.tolist()
    assert seven.order.tolist() == direct.order.tolist()
    assert seven.documents.tolist() != eight.documents.tolist()


def test_a_fractional_held_out_count_rounds_up():
    """0.1 of 25 documents is 2.5: 3 validation documents (ceil), 22 for training."""
    from pretrain.data.samples import split_documents

    sizes = [len(split_documents(25, split=s, valid_fraction=0.1, test_fraction=0.1, seed=1))
             for s in ("train", "valid", "test")]
    assert sizes == [19, 3, 3]


def test_the_configs_valid_fraction_sizes_the_validation_split(two_datasets):  # noqa: F811
    """0.1 of the 200 documents of the first dataset: 20 validation documents, 180 training
    ones (tests/test_data_blend.py checks only that the two are disjoint)."""
    from pretrain.data import build_datasets

    data = DataConfig(dataset=two_datasets[0], valid_fraction=0.1, seed=5)
    train, valid = build_datasets(data, seq_length=16, train_samples=8, with_valid=True)
    assert (len(train.documents), len(valid.documents)) == (180, 20)
