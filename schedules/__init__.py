"""Pipeline schedules as data, installed as `pxform.schedules`. They arrive with the
pipeline issue: each is a pure function `(stages, microbatches, **options) -> {rank:
[Action | None]}`."""
