# dex-tasks: one image for the worker, beat and the API (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

COPY pyproject.toml README.md LICENSE ./
COPY dex_tasks ./dex_tasks
COPY workers ./workers
COPY beat_schedule.py ./
RUN pip install ".[postgres,flower,otel]"

# Your tools, installed into the image: pip requirement(s) separated by spaces (your package
# from an index or a git URL, and whatever the tools import), e.g.
#   docker compose build --build-arg TOOLS_REQUIREMENTS="my-company-tools==1.4"
# Left empty, nothing is added. (set -f: a requirement like pkg[extra] is not a glob.)
ARG TOOLS_REQUIREMENTS=""
RUN set -f; if [ -n "$TOOLS_REQUIREMENTS" ]; then pip install $TOOLS_REQUIREMENTS; fi

# Or mount your tool packages here (docker-compose.yml mounts ./tools read-only): every
# dex-tasks process imports from it, so DEX_TOOLS=my_company.tools finds
# /opt/dex-tools/my_company/tools.py.
ENV PYTHONPATH=/opt/dex-tools
RUN mkdir -p /opt/dex-tools

# Never run tools as root: a tool is code the operator did not necessarily write.
RUN groupadd --system --gid 10001 dex \
    && useradd --system --uid 10001 --gid dex --home-dir /app --shell /usr/sbin/nologin dex \
    && chown -R dex:dex /app
USER dex

# The API's port; the worker and beat listen on nothing.
EXPOSE 8000

CMD ["dex-tasks", "--help"]
