# The skyresume service (API + reconciler). Training nodes do not use this image:
# SkyPilot provisions them and the task template installs the agent.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 SKYRESUME_HOME=/var/lib/skyresume
COPY pyproject.toml README.md ./
COPY orchestrator ./orchestrator
COPY training ./training
COPY migrations ./migrations
COPY task_templates ./task_templates
RUN pip install --no-cache-dir '.[postgres,cloud]' && useradd --system --home /var/lib/skyresume skyresume \
    && mkdir -p /var/lib/skyresume && chown skyresume /var/lib/skyresume
USER skyresume
EXPOSE 8470
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8470/readyz').status_code != 200)"
# Production databases are upgraded deliberately; this image does it on start
# because compose has no separate migration step.
CMD ["sh", "-c", "skyresume db upgrade && exec skyresume serve --host 0.0.0.0 --port 8470"]
