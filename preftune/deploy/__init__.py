"""Running preftune on Kubernetes: the `deploy:` config section, manifest rendering, validation
against the Kubernetes and CRD schemas, and cost estimates. Nothing here imports torch."""
