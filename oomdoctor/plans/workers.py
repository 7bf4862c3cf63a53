"""Worker pools for the plans' searches: forked, one intra-op thread each.

Forked so that workers inherit the model file's functions (a module made at run time, which
pickle cannot send by name). One thread each because a child forked after the parent has run
ATen's OpenMP thread pool can block forever in its first parallel region: GNU libgomp's threads
do not survive fork(), and its state says they exist. `recommend --trainings` hung that way
(its second search forks after the parent traced). With one thread ATen runs parallel regions
inline. The workers' traces are single-threaded Python anyway.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch


def forked_pool(processes: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"),
                               initializer=torch.set_num_threads, initargs=(1,))
