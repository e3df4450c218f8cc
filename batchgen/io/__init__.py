"""File jobs: OpenAI batch JSONL and Parquet in, one result or error per row out, resumable,
on any fsspec filesystem (docs/guides/file-jobs.md).

    storage.py       fsspec locations, storage options, globs/directories, compression, atomic writes
    source.py        Source: the files of one --input, their format and their digest
    spec.py          JobSpec: the settings of a job and the checks that run before any work
    fingerprint.py   what decides the outputs (input digest, model, options, version), for --resume
    openai_batch.py  JSONL lines -> Request; results -> OpenAI batch output records
    parquet.py       Parquet rows (a file or a dataset) -> Request; the output columns
    request.py       Request (a parsed row) and RowError
    rows.py          prompt -> token ids, fields -> SamplingParams, shared by both formats
    params.py        which request-body fields map to SamplingParams, which are refused
    cells.py         is_na: one DataFrame cell's missing value (for row-by-row readers)
    faults.py        whose fault a failed row is: 400 (the request's) or 500 (retryable, the server's)
    jsonl_sink.py    append + fsync writer (local); parts + commit (object storage)
    parquet_sink.py  part files as rows finish: a dataset with _SUCCESS, or one merged file
    sink.py          the Sink protocol; SplitSink (--error-file)
    backend.py       the Backend protocol (submit a chunk -> results as they finish)
    job.py           run_job / run_file_job: chunks through a backend, rows written as they finish
    report.py        exit codes and the job summary (request_counts, tokens, timing)
"""
