"""alignd/infra/stores."""
