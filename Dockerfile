# The agent-reach image: broker, sidecar and demo agent all run from it (see compose.yaml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY . .
# Runtime dependencies only: no dev extras, no embedded redis-server (compose runs Redis).
RUN pip install --no-cache-dir . \
    && useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin reach

WORKDIR /home/reach
USER reach

CMD ["agent-reach", "up"]
