"""Peak driver RSS of a long Parquet file job: does it stay flat as rows accumulate?

The driver's own memory is the reader, the job runner and the sink, so the engine is replaced
by an echo backend that answers each row at once with a fixed-size text (a model would only
add its own, constant, footprint and make 200k rows take hours on a CPU). The job reads a
Parquet input of ``--rows`` rows through the real ParquetReader (tokenizing every prompt with
the demo model's tokenizer) and writes through the real ParquetSink:

    --layout dataset   a Parquet dataset directory (parts as rows finish, _SUCCESS last)
    --layout file      one .parquet file (parts, then a merge that reads every part)

RSS is sampled every 0.1 s; the figures printed are the peak and the RSS after each quarter of
the rows. Run each layout in its own process (one at a time):

    python benchmarks/bench_file_job_memory.py --rows 200000 --layout dataset
    python benchmarks/bench_file_job_memory.py --rows 200000 --layout file

To compare with another checkout, put it first on PYTHONPATH (``--layout file`` only runs
against code from before dataset outputs).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
TEXT = "x" * 120  # each row's generated text


class Echo:
    """Answers every row at once: the driver's memory without an engine's."""

    def run(self, requests: Iterable[Any], max_in_flight: int) -> Iterator[tuple[int, Any]]:
        from batchgen.outputs import RequestOutput

        for position, item in enumerate(requests):
            ids = item[0]
            yield position, RequestOutput(position, ids, ids[:8], TEXT, "length")


class Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.proc, self.peak, self.running = psutil.Process(), 0, True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.1)


def write_input(path: Path, rows: int) -> None:
    writer = None
    for start in range(0, rows, 50_000):
        n = min(50_000, rows - start)
        prompts = [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(4 + i % 9)) for i in range(start, start + n)]
        table = pa.table({"prompt": prompts, "k": list(range(start, start + n))})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--layout", choices=["dataset", "file"], default="dataset")
    p.add_argument("--workdir", type=Path, help="default: a temporary directory")
    args = p.parse_args()

    from batchgen.demo import demo_model_dir
    from batchgen.io.job import run_job
    from batchgen.io.parquet import ParquetReader
    from batchgen.io.parquet_sink import ParquetSink
    from batchgen.io.rows import RowContext
    from batchgen.models.info import ModelInfo

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-file-job-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "in.parquet"
    if not src.exists():
        write_input(src, args.rows)
    info = ModelInfo.load(demo_model_dir())
    ctx = RowContext(info.tokenizer, info.vocab_size, info.max_model_len, {"max_tokens": 8})
    reader = ParquetReader(src, ctx)
    out = work / ("out" if args.layout == "dataset" else "out.parquet")
    sink = (ParquetSink(out, reader.schema, resume=False, dataset=True) if args.layout == "dataset"
            else ParquetSink(out, reader.schema, resume=False))

    sampler = Sampler()
    sampler.start()
    start_rss = psutil.Process().memory_info().rss
    quarters: list[int] = []
    marks = {args.rows * q // 4 for q in (1, 2, 3)}

    class Progress:
        n = 0

        def update(self, rows: int, tokens: int = 0) -> None:
            self.n += rows
            if self.n in marks:
                quarters.append(psutil.Process().memory_info().rss)

    t0 = time.monotonic()
    summary = run_job(reader.requests(set()), sink, Echo(), chunk_size=1024, progress=Progress())  # type: ignore[arg-type]
    quarters.append(psutil.Process().memory_info().rss)  # after the commit
    sampler.running = False
    sampler.join()
    mib = 1 << 20
    print(json.dumps({
        "layout": args.layout, "rows": summary.rows, "wall_s": round(time.monotonic() - t0, 1),
        "rss_start_mib": round(start_rss / mib, 1), "rss_peak_mib": round(max(sampler.peak, *quarters) / mib, 1),
        "rss_at_quarters_mib": [round(q / mib, 1) for q in quarters], "pid": os.getpid(),
        "batchgen": __import__("batchgen").__file__,
    }))


if __name__ == "__main__":
    main()
