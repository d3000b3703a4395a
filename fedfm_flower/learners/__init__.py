"""Server-side learners: pFedSeq's sequential learner (Mamba, LSTM, MLP) and its server step."""
