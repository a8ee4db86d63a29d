"""Task generators: problems with reference answers and the demonstrations an SFT stage trains on — the
multi-step arithmetic task (``arith``), the register machine of TIP (``regmachine``) and Pasta's independent
chains (``pasta``). Their verifier is ``sliderl.rewards.arith.ArithVerifier``."""
