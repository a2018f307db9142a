"""skyresume's in-job training library (imports torch)."""
