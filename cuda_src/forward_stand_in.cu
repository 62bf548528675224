// A stand-in for a model's forward pass, for the host-side benchmarks: one thread keeps the
// stream busy for ns nanoseconds (the GPU's global timer), so the host waits in a stream
// synchronise as an engine does between steps, and a thread mapping chunks meanwhile can run.
namespace pagedrt {

__global__ void forward_stand_in(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (static_cast<long long>(now - start) < ns);
}

}  // namespace pagedrt
