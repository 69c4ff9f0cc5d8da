// Node 20 lacks Promise.withResolvers (Node 22 has it), which js-libp2p's dependencies call.
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function () {
    let resolve, reject
    const promise = new this((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}
