# dex-tasks: one image for the worker, beat and the API (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

COPY pyproject.toml README.md ./
COPY dex_tasks ./dex_tasks
COPY workers ./workers
COPY beat_schedule.py ./
RUN pip install ".[postgres]"

# Never run tools as root: a tool is code the operator did not necessarily write.
RUN groupadd --system --gid 10001 dex \
    && useradd --system --uid 10001 --gid dex --home-dir /app --shell /usr/sbin/nologin dex \
    && chown -R dex:dex /app
USER dex

# The API's port; the worker and beat listen on nothing.
EXPOSE 8000

CMD ["dex-tasks", "--help"]
