"""Blending several datasets with weights into one stream of samples (e.g. 0.7 code, 0.3 prose).

A blend is a list of ``(weight, prefix)`` pairs, written in a run config as strings
``"0.7 runs/data/code"`` or mappings ``{weight: 0.7, prefix: runs/data/code}``. Weights are
relative (normalised to sum 1).

For a blend of N samples, dataset d gets exactly ``c_d`` samples, where the counts are
``weight_d * N`` rounded by largest remainder: each within one sample of its target, summing to N.
Their order interleaves the datasets evenly: dataset d's k-th sample is placed at "time"
``(k + 0.5) / c_d`` and all samples are sorted by time (ties by dataset order), so every prefix
of the stream is also close to the weights, as in Megatron's ``BlendedDataset`` whose greedy
rule picks the dataset lagging its target most. Unlike that loop this is a few vectorised NumPy
calls, so a blend of hundreds of millions of samples builds in seconds. The schedule depends only
on the weights and N; the samples within each dataset follow its own seeded shuffled order, so
a blend is deterministic for a seed.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pretrain.errors import DataError

def blend_counts(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """Samples per dataset: ``weights * num_samples`` by largest remainder (sums to N)."""
    weights = np.asarray(weights, dtype=np.float64)
    targets = weights / weights.sum() * num_samples
    counts = np.floor(targets).astype(np.int64)
    shortfall = num_samples - int(counts.sum())
    # Largest remainders first; a stable sort breaks ties by dataset order.
    counts[np.argsort(-(targets - counts), kind="stable")[:shortfall]] += 1
    return counts


def blend_schedule(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of blend sample i, its sample number within that dataset), for i < num_samples."""
    counts = blend_counts(weights, num_samples)
    datasets = np.repeat(np.arange(len(counts), dtype=np.int16), counts)
    within = np.arange(num_samples, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    times = (within + 0.5) / np.repeat(counts, counts)
    order = np.lexsort((datasets, times))  # by time, then by dataset
    return datasets[order], within[order]


class BlendedSamples:
    """`num_samples` samples drawn from several sample datasets by `blend_schedule`.

    A map-style dataset for `torch.utils.data.DataLoader` (any object with ``__len__`` and
    ``__getitem__``). A dataset asked for more samples than it has starts over in its own order
    (another epoch of it), so a small dataset with a large weight repeats.
    """

    def __init__(self, datasets: Sequence, *, weights: Sequence[float], num_samples: int) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"a blend needs one weight per dataset, got {len(weights)} weights "
                            f"for {len(datasets)} datasets")
        if num_samples < 1:
            raise DataError(f"a blend needs at least one sample, got num_samples={num_samples}")
        self.datasets = list(datasets)
        self.weights = [float(w) for w in weights]
        self.dataset_index, self.dataset_sample_index = blend_schedule(weights, num_samples)

    def __getstate__(self) -> dict:
        # The schedule is recomputed (cheap), not sent to every spawned DataLoader worker.
        return {"datasets": self.datasets, "weights": self.weights, "num_samples": len(self)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["datasets"], weights=state["weights"],
                      num_samples=state["num_samples"])

    def __len__(self) -> int:
        return len(self.dataset_index)

    def counts(self) -> np.ndarray:
        """Samples drawn from each dataset."""
        return np.bincount(self.dataset_index, minlength=len(self.datasets))

    def tokens(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of blend sample `index`."""
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset.tokens(int(self.dataset_sample_index[index]) % len(dataset))

    def __getitem__(self, index: int):
        """``{"input_ids", "labels"}`` of blend sample `index`, as `PackedSamples` gives."""
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index]) % len(dataset)]
