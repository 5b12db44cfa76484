"""The gcpo section of the run configuration (train.algorithm gcpo): how the trained steps are cut into chunks and
how many chunks each sample trains. Its defaults are GCPO's published PickScore recipe (xingzhejun/GCPO ea6cc4d,
scripts/finetune/finetune_pickscore_chunk.sh:36, 44-46: --timestep_fraction 0.5 --use_chunk --new_fix_chunk
--new_chunk_list '[2, 3, 4, 7]').

The chunks cut the C = sampling.num_steps - 1 candidate steps (the trajectory's last transition is not trained, as
GCPO's samples drop it: fastvideo/train_grpo_flux_pickscore.py:533-540) into consecutive runs, from high noise to
low: `chunks` lists their sizes (new_chunk_list; they must add up to C), or, with `chunks: []`, runs of
`chunk_size` with the remainder last (fastvideo/utils/chunk.py:5-12). Each sample trains its own random
int(number of chunks x chunk_fraction) of them (train_grpo_flux_pickscore.py:663-671: a randperm per sample).

A chunk is a JAGG window: its loss reads the chunk's mean log-probability, so one joint pass over the chunk's two end
steps carries it (docs/algorithm.md, "Chunk-level GRPO"). Rows train different chunks, so the minibatch is laid out in
slots of P = the longest chunk's size positions (a shorter chunk padded inside, its pads weighing nothing), and the
JAGG window must be that slot: jagg.window = P (config.py refuses another, or a planner whose windows are not slots).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sections import Section, require

__all__ = ["GCPOConfig", "chunk_sizes", "trained_chunks"]


def chunk_sizes(chunks, chunk_size: int, candidates: int) -> list[int]:
    """The chunks' sizes over `candidates` steps: `chunks` as given, or runs of `chunk_size` and the remainder last
    (GCPO's set_chunk, fastvideo/utils/chunk.py:2-12)."""
    if chunks:
        return list(chunks)
    n, last = divmod(candidates, chunk_size)
    return [chunk_size] * n + ([last] if last else [])


def trained_chunks(n_chunks: int, fraction: float) -> int:
    """How many chunks a sample trains: int(n_chunks x fraction) (train_grpo_flux_pickscore.py:671)."""
    return int(n_chunks * fraction)


@dataclass
class GCPOConfig(Section):
    # the chunks' sizes, from high noise to low (GCPO's --new_chunk_list with --new_fix_chunk): they add up to
    # sampling.num_steps - 1; [] cuts the steps into runs of chunk_size instead
    chunks: tuple[int, ...] = (2, 3, 4, 7)
    chunk_size: int = 4  # with chunks []: the run length, the remainder a last, shorter chunk (--chunk_size, 4)
    chunk_fraction: float = 0.5  # each sample trains int(number of chunks x this) random chunks (--timestep_fraction)

    def layout(self, num_steps: int) -> list[int]:
        """The chunks' sizes for a schedule of `num_steps` sampling steps (C = num_steps - 1 candidates)."""
        return chunk_sizes(self.chunks, self.chunk_size, max(1, num_steps - 1))

    def trained_count(self, num_steps: int) -> int:
        """K: the trained positions per sample, its chunk slots' pads included (gcpo/chunks.py slot_layout)."""
        sizes = self.layout(num_steps)
        return trained_chunks(len(sizes), self.chunk_fraction) * max(sizes)

    def expected_steps(self, num_steps: int) -> float:
        """The real steps a sample trains, in expectation over its uniform draw of chunks (pads not counted):
        n_train x the mean chunk size. GCPO's own step backpropagates these (the estimator prices it so)."""
        sizes = self.layout(num_steps)
        return trained_chunks(len(sizes), self.chunk_fraction) * sum(sizes) / len(sizes)

    def check(self, prefix: str) -> None:
        require(all(c >= 1 for c in self.chunks), f"{prefix}.chunks", f"must hold sizes >= 1, got {list(self.chunks)}")
        require(self.chunk_size >= 1, f"{prefix}.chunk_size", f"must be >= 1, got {self.chunk_size}")
        require(0 < self.chunk_fraction <= 1, f"{prefix}.chunk_fraction",
                f"must be in (0, 1], got {self.chunk_fraction}")
        if self.chunks:
            require(not self.is_set("chunk_size"), f"{prefix}.chunk_size",
                    f"cuts the steps only with {prefix}.chunks [] (the chunks are listed): unset it "
                    f"({prefix}.chunk_size=null) or set {prefix}.chunks=[]")

    def check_schedule(self, prefix: str, num_steps: int) -> None:
        """The chunks against the schedule of `num_steps` sampling steps (config.validate)."""
        C = num_steps - 1
        require(C >= 1, "sampling.num_steps", f"must be >= 2 with train.algorithm gcpo (it trains the first "
                f"num_steps - 1), got {num_steps}")
        if self.chunks:
            require(sum(self.chunks) == C, f"{prefix}.chunks", f"{list(self.chunks)} must add up to the "
                    f"{C} trained candidate steps (sampling.num_steps - 1), as GCPO's chunk list covers its 16 of 17")
        else:
            require(self.chunk_size <= C, f"{prefix}.chunk_size",
                    f"{self.chunk_size} is longer than the {C} candidate steps (sampling.num_steps - 1)")
        n = len(self.layout(num_steps))
        require(trained_chunks(n, self.chunk_fraction) >= 1, f"{prefix}.chunk_fraction",
                f"{self.chunk_fraction} of {n} chunks trains none (int({n} x {self.chunk_fraction}) = 0): raise it")
