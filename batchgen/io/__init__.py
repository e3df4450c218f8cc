"""File jobs: OpenAI batch JSONL and Parquet in, one result or error per row out, resumable.

    spec.py          JobSpec: the settings of a job and the checks that run before any work
    openai_batch.py  JSONL lines -> Request; results -> OpenAI batch output records
    parquet.py       Parquet rows -> Request
    request.py       Request (a parsed row) and RowError
    rows.py          prompt -> token ids, fields -> SamplingParams, shared by both formats
    params.py        which request-body fields map to SamplingParams, which are refused
    cells.py         is_na: one DataFrame cell's missing value (for row-by-row readers)
    jsonl_sink.py    append + fsync writer; --resume truncates a torn last line
    parquet_sink.py  part files renamed into <output>.parts/, one atomic merge at the end
    backend.py       the Backend protocol (submit a chunk -> results as they finish)
    job.py           run_job / run_file_job: chunks through a backend, rows written as they finish
"""
