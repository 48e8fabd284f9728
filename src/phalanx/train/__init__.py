"""The fine-tuning loop and what it calls: loss, schedule, evaluation, run assembly."""
