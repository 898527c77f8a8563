"""What several test modules share: reference implementations, models, trainers and process set-up."""
