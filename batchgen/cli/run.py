"""`batchgen run` (a text, image or multi-model file job) and `batchgen demo`, in this process or
on a Dask cluster."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cluster_session import cluster_session
from .parser import engine_options, param_columns, sampling_defaults
from .reports import check_report, finish, write_report

if TYPE_CHECKING:
    from batchgen.io.job import JobSummary
    from batchgen.io.spec import JobSpec


def _job_spec(args: argparse.Namespace, **kw: Any) -> JobSpec:
    """The run command's JobSpec, with what decides its outputs for ``--resume`` (the models'
    identities, the options that change tokens)."""
    from batchgen.io.fingerprint import model_identity
    from batchgen.io.report import check_rate
    from batchgen.io.spec import JobSpec
    from batchgen.io.storage import parse_storage_options

    check_rate(args.max_error_rate)
    if args.models:
        from batchgen.moa.backend import parse_models

        models = {name: model_identity(path) for name, path in parse_models(args.models).items()}
    else:
        models = {"model": model_identity(args.model)}
    options = {"dtype": args.dtype or "auto"}
    return JobSpec(input=args.input, output=args.output, resume=args.resume, overwrite=args.overwrite,
                   storage_options=parse_storage_options(args.storage_option), retry_errors=args.retry_errors,
                   force_resume=args.force_resume, error_file=args.error_file,
                   job={"models": models, "options": options}, **kw)


def run_command(args: argparse.Namespace) -> int:
    check_report(args)
    if args.model and (Path(args.model) / "model_index.json").is_file():  # a diffusers pipeline: image generation
        return _run_images(args)

    spec = _job_spec(args, defaults=sampling_defaults(args), prompt_column=args.prompt_column,
                     id_column=args.id_column, param_columns=param_columns(args.param_column),
                     per_row_params=args.per_row_params)
    spec.check()
    if args.models:
        return _run_models(spec, args)
    summary = execute(spec, args.model, args)
    return finish(args, spec, summary)


def _run_images(args: argparse.Namespace) -> int:
    """An image job: a text job's checks and runner with the image reader, sink and backend
    (batchgen/diffusion/jobs/images_batch.py), in this process or on a Dask cluster."""
    from batchgen.diffusion.distributed.engine_spec import image_spec
    from batchgen.diffusion.jobs.images_batch import IMAGE_FORMATS, cluster_stream, engine_stream, run_images_job
    from batchgen.diffusion.models.pipeline import read_index

    spec = _job_spec(args, formats=IMAGE_FORMATS)
    spec.check()
    options = {"dtype": args.dtype or "auto", "device": args.device, "max_image_tokens": args.max_image_tokens}
    name = Path(args.model).name
    if args.scheduler or args.workers:
        from batchgen.io.dask_backend import DaskBackend

        read_index(args.model)  # not a supported pipeline: exit 2 before any work (weights load on the workers)
        engine = image_spec(args.model, options)
        with cluster_session(args, engine.key) as client:
            summary = run_images_job(spec, cluster_stream(DaskBackend(client, engine)), model_name=name,
                                     chunk_size=args.chunk_size, progress=args.progress)
    else:
        from batchgen.diffusion.engine.diffusion_engine import DiffusionEngine

        local = DiffusionEngine(args.model, **options)  # ModelLoadError: exit 2
        summary = run_images_job(spec, engine_stream(local), model_name=name, chunk_size=args.chunk_size,
                                 progress=args.progress)
    return finish(args, spec, summary)


def _run_models(spec: JobSpec, args: argparse.Namespace) -> int:
    from batchgen.moa.backend import parse_models, run_models_file_job

    models = parse_models(args.models)
    client = cluster = None
    if args.scheduler or args.workers:
        from distributed import Client

        from batchgen.cluster.client import install, local_cluster

        cluster = None if args.scheduler else local_cluster(args.workers)
        client = Client(args.scheduler) if args.scheduler else Client(cluster)
        install(client)
    try:
        summary, placement = run_models_file_job(spec, models, client=client, placement=args.placement,
                                                 engine_options=engine_options(args), chunk_size=args.chunk_size,
                                                 progress=args.progress)
        if client is not None and getattr(args, "report", None):
            write_report(args.report, client)
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
    where = f"; placement {placement.describe()}" if placement is not None else ""
    return finish(args, spec, summary, where)


def execute(spec: JobSpec, model: str | Path, args: argparse.Namespace) -> JobSummary:
    from batchgen.io.job import run_file_job

    if getattr(args, "scheduler", None) or getattr(args, "workers", None):
        return _execute_on_cluster(spec, model, args)
    from batchgen.engine import Engine

    engine = Engine(model, **engine_options(args))  # ModelLoadError: exit 2
    try:
        return run_file_job(spec, engine, chunk_size=args.chunk_size, progress=args.progress)
    finally:
        engine.close()


def _execute_on_cluster(spec: JobSpec, model: str | Path, args: argparse.Namespace) -> JobSummary:
    """The driver reads config and tokenizer only; the weights load on the workers."""
    from batchgen.cluster.spec import EngineSpec
    from batchgen.io.dask_backend import DaskBackend
    from batchgen.io.job import run_file_job
    from batchgen.models.info import ModelInfo

    info = ModelInfo.load(model)  # ModelLoadError / UnsupportedModelError: exit 2, before any work
    engine = EngineSpec.make(model, engine_options(args))
    with cluster_session(args, engine.key) as client:
        return run_file_job(spec, info, chunk_size=args.chunk_size, progress=args.progress,
                            backend=DaskBackend(client, engine))



def demo_command(args: argparse.Namespace) -> int:
    from batchgen.demo.run import run_demo

    return run_demo(args, execute)
