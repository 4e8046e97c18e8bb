[Thread debugging using libthread_db enabled]
Using host libthread_db library "/lib/x86_64-linux-gnu/libthread_db.so.1".
0x00007f551e2455b9 in sigsuspend () from /lib/x86_64-linux-gnu/libc.so.6
No CUDA kernels.
No CUDA blocks.
No CUDA threads.
[Inferior 1 (process 1599) detached]
