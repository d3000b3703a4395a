"""fedfm-flower: personalized federated fine-tuning of foundation models on Flower."""

__version__ = "0.1.0"
