/* attnres-probe dashboard: the two view changes that run in the browser.
 * pick_token: a token chip click (or a click on a one-source heatmap cell) -> the token store.
 * mark_chips: highlight the selected chip.
 * Token text is never written as HTML here; Dash renders chip children as text. */
window.dash_clientside = Object.assign({}, window.dash_clientside, {
    attnres: {
        pick_token: function () {
            var nu = window.dash_clientside.no_update;
            var state = arguments[arguments.length - 1];
            var ctx = window.dash_clientside.callback_context;
            if (!state || !ctx || !ctx.triggered || ctx.triggered.length !== 1) { return nu; }
            var trig = ctx.triggered[0];
            if (!trig.value) { return nu; }  // chips re-rendered for a new text: no click yet
            var id = trig.prop_id, token;
            if (id.slice(-9) === ".n_clicks") {
                token = JSON.parse(id.slice(0, -9)).index;
            } else if (trig.value.points && trig.value.points.length) {
                token = trig.value.points[0].x;
                // a long trace's heatmap names its columns "12 'a'" (position, token)
                if (typeof token === "string") { token = parseInt(token, 10); if (isNaN(token)) { token = undefined; } }
            }
            if (typeof token !== "number" || token === state.token) { return nu; }
            return {key: state.key, token: token};
        },
        mark_chips: function (state, ids) {
            var sel = state ? state.token : -1;
            return ids.map(function (id) { return id.index === sel ? "chip selected" : "chip"; });
        }
    }
});
