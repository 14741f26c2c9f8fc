"""The deployment files (Dockerfiles, Kubernetes manifests) checked without building or
applying them: hadolint, parsing and offline schema validation, no server."""
